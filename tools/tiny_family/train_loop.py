"""One seeded training loop for every member of the family.

A member supplies `loss_fn(model, batch) -> scalar` (next-token loss for a target, distillation or
MTP losses for drafters) and `next_batch()`; the loop owns the optimizer, the warmup + cosine
schedule, bf16 autocast on CUDA, gradient clipping and the loss log.
"""

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

LossFn = Callable[[torch.nn.Module, torch.Tensor], torch.Tensor]


@dataclass
class TrainConfig:
    steps: int
    batch_size: int
    seq_len: int
    lr: float = 3e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 200
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    log_every: int = 100
    seed: int = 0

    def __post_init__(self):
        if not 0 <= self.warmup_steps < self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be in [0, steps={self.steps})")


@dataclass
class TrainResult:
    losses: list[tuple[int, float]] = field(default_factory=list)  # (step, mean train loss since last log)
    eval_losses: list[tuple[int, float]] = field(default_factory=list)  # (step, evaluate() nats/token)
    wall_time_s: float = 0.0
    tokens_seen: int = 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay from `lr` to `lr * min_lr_ratio` at the last step."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - 1 - cfg.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * cosine)


def make_optimizer(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices (embeddings included) decay, norms, scales and biases do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = all(p.is_cuda for p in params)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)


def causal_lm_loss(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; `batch` is `[batch_size, seq_len + 1]` token ids."""
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def train(
    model: torch.nn.Module, loss_fn: LossFn, next_batch: Callable[[], torch.Tensor], cfg: TrainConfig,
    log: Callable[[str], None] = print, evaluate: Callable[[], float] | None = None, eval_every: int = 0,
) -> TrainResult:
    """Runs `cfg.steps` optimizer steps on `model` (in place; pass a `torch.compile`d module to compile).

    `evaluate()` (a validation loss; model in eval mode) runs every `eval_every` steps, for the curve only.
    """
    device = next(model.parameters()).device
    optimizer = make_optimizer(model, cfg)
    result, running, start, eval_time = TrainResult(), [], time.perf_counter(), 0.0
    model.train()
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        batch = next_batch()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            loss = loss_fn(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        running.append(loss.detach())
        result.tokens_seen += batch.shape[0] * (batch.shape[1] - 1)
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            mean_loss = torch.stack(running).mean().item()  # the one host sync per log interval
            running.clear()
            result.losses.append((step + 1, mean_loss))
            elapsed = time.perf_counter() - start - eval_time
            log(f"step {step + 1:6d}/{cfg.steps}  loss {mean_loss:.4f}  lr {lr_at(step, cfg):.2e}  "
                f"{result.tokens_seen / elapsed:,.0f} tok/s  {elapsed:.0f}s")
        if evaluate is not None and eval_every and (step + 1) % eval_every == 0 and step + 1 < cfg.steps:
            eval_start = time.perf_counter()
            model.eval()
            result.eval_losses.append((step + 1, evaluate()))
            model.train()
            eval_time += time.perf_counter() - eval_start
            log(f"step {step + 1:6d}/{cfg.steps}  eval loss {result.eval_losses[-1][1]:.4f}")
    result.wall_time_s = time.perf_counter() - start - eval_time
    model.eval()
    return result
