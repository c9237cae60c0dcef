"""Training tooling for the bundled tiny model family (docs/architecture.md, "The bundled tiny family"); never imported by `hf_specdec`.

Every member is trained from the same pieces, so a new member adds one recipe module (its config and
`build_model`) and one CLI (`train_<member>.py`, taking at least `--steps --out --report`):

- `corpus`     stdlib `*.py` files (this interpreter's, a folder, or a packed .tar.gz), split
               train / validation / held-out by a hash of each path;
- `tokenizer`  the family's byte-level BPE (trained once, with the target; later members load it
               from `hf_specdec/assets/tiny-gemma4`) and `encode_documents` (`[bos] text [eos]`);
- `data`       token streams, seeded random training windows, overlapping evaluation windows;
- `train_loop` seeded AdamW + warmup/cosine loop with bf16 autocast for any `loss_fn(model, batch)`;
- `evaluate`   per-document cross-entropy and bits per byte;
- `export`     a standard Hugging Face checkpoint in bf16, and the bundled held-out snippets;
- `cli`        the options every CLI shares (loop, device, drafter τ), its `TrainConfig`, the report file;
- `frozen_target` the frozen target a drafter learns from, with the target's token streams;
- `measure`    a drafter's τ and CPU tokens/s through hf_specdec's speculative loop;
- `sweep`      several runs of one member side by side on one GPU, keeping the best on validation.

Members: `gemma4_target` + `train_target` (the Gemma 4 target; also trains the tokenizer).
`gemma4_assistant` + `train_assistant` (its MTP assistant, distilled from the frozen target).
`step3p5_model` + `train_step3p5` (Step 3.5 with 3 MTP layers, trained jointly with its MTP losses).
`gemma4_dflash` + `train_dflash` (the target's DFlash drafter, trained with the block objective).
Numbers and rebuild commands: `hf_specdec/assets/README.md`.
"""
