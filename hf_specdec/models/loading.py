"""What the model packages share when they load checkpoints."""

from __future__ import annotations


def check_checkpoint_keys(info: dict, what: str) -> None:
    """Raise when a checkpoint's keys do not match the model's layout (``info``: transformers' loading info)."""
    missing, unexpected = sorted(info.get("missing_keys", ())), sorted(info.get("unexpected_keys", ()))
    if missing or unexpected:
        raise ValueError(
            f"{what} checkpoint does not match the expected layout: missing keys {missing}, unexpected keys "
            f"{unexpected}. Pass output_loading_info=True to load anyway and inspect them."
        )
