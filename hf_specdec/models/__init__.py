"""Model-specific code: drafters and target adapters, one sub-package per model family."""
