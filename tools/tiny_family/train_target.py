"""Train the family tokenizer and the tiny Gemma 4 target, then export both as one HF checkpoint.

    python -m tools.tiny_family.train_target --corpus .carry/stdlib-3.11.7.tar.gz \
        --out hf_specdec/assets/tiny-gemma4 --snippets hf_specdec/assets/held_out_snippets.json \
        --report tools/tiny_family/results/tiny-gemma4.json

Seeded: the corpus order, the tokenizer, the initial weights and the batch order depend only on
`--seed` and the corpus; GPU reductions may still differ in the last bits between runs.
"""

import argparse
import json
import pathlib
import time

import torch
import transformers

from . import gemma4_target
from .corpus import load_corpus
from .data import RandomWindows, TokenStream
from .evaluate import bits_per_byte, causal_lm_logits, score_documents
from .export import export_checkpoint, select_snippets, write_snippets
from .tokenizer import encode_documents, train_bpe
from .train_loop import TrainConfig, causal_lm_loss, seed_everything, train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True, help="checkpoint folder to write")
    p.add_argument("--report", type=pathlib.Path, help="JSON file for data stats, config, loss curves, metrics")
    p.add_argument("--snippets", type=pathlib.Path, help="JSON file for the bundled held-out snippets")
    p.add_argument("--corpus", type=pathlib.Path, help="stdlib folder or corpus .tar.gz (default: this stdlib)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup-steps", type=int, default=200)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=100)
    p.add_argument("--eval-every", type=int, default=500, help="validation loss every N steps (0: never)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return p.parse_args(argv)


def split_scores(scores, documents) -> dict:
    nats, tokens = sum(s.nats for s in scores), sum(s.num_tokens for s in scores)
    num_bytes = sum(d.num_bytes for d in documents)
    return {"loss_nats_per_token": nats / tokens, "tokens": tokens, "bytes": num_bytes,
            "bits_per_byte": bits_per_byte(nats, num_bytes)}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    seed_everything(args.seed)
    report: dict = {"args": {k: str(v) if isinstance(v, pathlib.Path) else v for k, v in vars(args).items()}}

    # 1. Corpus and tokenizer.
    corpus = load_corpus(args.corpus)
    start = time.perf_counter()
    tokenizer = train_bpe((d.text for d in corpus.train), args.vocab_size)
    report["tokenizer"] = {"vocab_size": len(tokenizer), "train_time_s": round(time.perf_counter() - start, 1),
                           "special_tokens": {t: tokenizer.convert_tokens_to_ids(t) for t in tokenizer.all_special_tokens}}

    # 2. Token ids: one training stream; validation and held-out files scored document by document.
    train_stream = TokenStream.from_documents(encode_documents(tokenizer, [d.text for d in corpus.train]))
    validation_ids = encode_documents(tokenizer, [d.text for d in corpus.validation])
    held_out_ids = encode_documents(tokenizer, [d.text for d in corpus.held_out])
    report["data"] = corpus.summary() | {"train_tokens": train_stream.ids.numel(),
                                         "held_out_tokens": sum(map(len, held_out_ids))}
    print("data", json.dumps(report["data"] | report["tokenizer"]), flush=True)

    # 3. Model and loop configuration.
    model = gemma4_target.build_model(tokenizer).to(device)
    report["num_parameters"] = sum(p.numel() for p in model.parameters())
    print(f"parameters {report['num_parameters']:,}", flush=True)
    cfg = TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                      warmup_steps=args.warmup_steps, weight_decay=args.weight_decay, log_every=args.log_every,
                      seed=args.seed)
    score_kwargs = dict(seq_len=args.seq_len, stride=args.seq_len // 2, batch_size=args.batch_size,
                        pad_id=tokenizer.pad_token_id, device=device)
    autocast = torch.bfloat16 if device.type == "cuda" else None

    def validation_loss() -> float:
        scores = score_documents(causal_lm_logits(model), validation_ids, autocast_dtype=autocast, **score_kwargs)
        return sum(s.nats for s in scores) / sum(s.num_tokens for s in scores)

    # 4. Train (the compiled module shares its parameters with `model`).
    trained = torch.compile(model) if args.compile else model
    batches = RandomWindows(train_stream.to(device), cfg.batch_size, cfg.seq_len, cfg.seed)
    result = train(trained, causal_lm_loss, batches, cfg, evaluate=validation_loss, eval_every=args.eval_every,
                   log=lambda line: print(line, flush=True))
    report["training"] = {
        "steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, "lr": cfg.lr,
        "warmup_steps": cfg.warmup_steps, "min_lr_ratio": cfg.min_lr_ratio, "weight_decay": cfg.weight_decay,
        "betas": cfg.betas, "grad_clip": cfg.grad_clip, "tokens_seen": result.tokens_seen,
        "epochs": round(result.tokens_seen / train_stream.ids.numel(), 2), "wall_time_s": round(result.wall_time_s, 1),
        "final_train_loss": result.losses[-1][1], "train_loss_curve": result.losses,
        "validation_loss_curve": result.eval_losses,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "compile": args.compile, "torch": torch.__version__, "transformers": transformers.__version__,
    }

    # 5. Export in bf16, then score the exported weights (upcast to fp32) on validation and held-out files.
    files = export_checkpoint(model, tokenizer, args.out, gemma4_target.write_real_checkpoint_keys)
    model.float()
    validation = score_documents(causal_lm_logits(model), validation_ids, **score_kwargs)
    held_out = score_documents(causal_lm_logits(model), held_out_ids, **score_kwargs)
    report["validation"] = split_scores(validation, corpus.validation)
    report["held_out"] = split_scores(held_out, corpus.held_out) | {"per_file_bits_per_byte": {
        d.path: round(bits_per_byte(s.nats, d.num_bytes), 3) for d, s in zip(corpus.held_out, held_out)}}
    report["files"] = files | {"total": sum(files.values())}
    for key in ("validation", "held_out", "files"):
        print(key, json.dumps(report[key]), flush=True)

    if args.snippets:
        snippets = select_snippets(corpus.held_out, num_snippets=6, max_bytes=1400)
        write_snippets(snippets, args.snippets, f"held-out files of the Python {corpus.python_version} stdlib")
    if args.report:
        args.report.parent.mkdir(parents=True, exist_ok=True)
        args.report.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
