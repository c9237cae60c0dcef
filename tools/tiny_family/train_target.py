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

from . import cli, gemma4_target
from .corpus import load_corpus
from .data import RandomWindows, TokenStream
from .evaluate import CausalLMScorer, bits_per_byte, split_scores
from .export import export_checkpoint, select_snippets, write_snippets
from .tokenizer import encode_documents, train_bpe
from .train_loop import causal_lm_loss, seed_everything, train


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=pathlib.Path, required=True, help="checkpoint folder to write")
    p.add_argument("--report", type=pathlib.Path, help="JSON file for data stats, config, loss curves, metrics")
    p.add_argument("--snippets", type=pathlib.Path, help="JSON file for the bundled held-out snippets")
    cli.add_corpus_arg(p)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=512)
    cli.add_optimizer_args(p, warmup_steps=200)
    cli.add_run_args(p, eval_every=500, evaluated="validation loss")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    cli.add_device_arg(p)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = torch.device(args.device)
    seed_everything(args.seed)
    report: dict = {"args": cli.args_record(args)}

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
    cfg = cli.train_config(args, steps=args.steps, seq_len=args.seq_len)
    scorer = CausalLMScorer(args.seq_len, args.batch_size, tokenizer.pad_token_id, device)
    autocast = torch.bfloat16 if device.type == "cuda" else None

    # 4. Train (the compiled module shares its parameters with `model`).
    trained = torch.compile(model) if args.compile else model
    batches = RandomWindows(train_stream.to(device), cfg.batch_size, cfg.seq_len, cfg.seed)
    result = train(trained, causal_lm_loss, batches, cfg, evaluate=lambda: scorer.loss(model, validation_ids, autocast),
                   eval_every=args.eval_every, log=lambda line: print(line, flush=True))
    report["training"] = {
        "steps": cfg.steps, "batch_size": cfg.batch_size, "seq_len": cfg.seq_len, **cli.schedule_record(cfg),
        "tokens_seen": result.tokens_seen, **cli.curve_record(result, train_stream.ids.numel()),
        "validation_loss_curve": result.eval_losses, "device": cli.device_name(device), "compile": args.compile,
        **cli.versions(),
    }

    # 5. Export in bf16, then score the exported weights (upcast to fp32) on validation and held-out files.
    files = export_checkpoint(model, tokenizer, args.out, gemma4_target.write_real_checkpoint_keys)
    model.float()
    validation, held_out = scorer.scores(model, validation_ids), scorer.scores(model, held_out_ids)
    report["validation"] = split_scores(validation, corpus.validation)
    report["held_out"] = split_scores(held_out, corpus.held_out) | {"per_file_bits_per_byte": {
        d.path: round(bits_per_byte(s.nats, d.num_bytes), 3) for d, s in zip(corpus.held_out, held_out)}}
    report["files"] = files | {"total": sum(files.values())}
    for key in ("validation", "held_out", "files"):
        print(key, json.dumps(report[key]), flush=True)

    if args.snippets:
        snippets = select_snippets(corpus.held_out, num_snippets=6, max_bytes=1400)
        write_snippets(snippets, args.snippets, f"held-out files of the Python {corpus.python_version} stdlib")
    cli.write_report(args.report, report)
    return report


if __name__ == "__main__":
    main()
