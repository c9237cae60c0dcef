"""Every benchmark's --smoke mode runs in-process on the CPU, writes records with the common fields, and its
token checks hold (timings are never asserted here: they live in benchmarks/)."""

from __future__ import annotations

import importlib
import json
import os

import pytest
import torch

from benchmarks.common import RECORD_FIELDS, run_bench
from benchmarks.run_all import BENCHES
from hf_specdec.assets import available_assets


_RUNS: dict[str, tuple] = {}  # each bench's smoke run happens once per session: (records, last stdout line)


@pytest.fixture
def clock_of_the_work(monkeypatch):
    """The benches' timer as a function of the work: a generate call takes a millisecond per position of the
    sequences it returns (other timed work keeps its real time). These tests check the benches' plumbing and tokens,
    never their timings, with calls of a few tokens, where two test processes on two cores once made a 4-token call
    look faster than a 1-token one, a rate ``decode_rate`` refuses."""
    from benchmarks import common

    real = common.timed

    def timed(fn):
        result, seconds = real(fn)
        sequences = getattr(result, "sequences", result)
        return result, (1e-3 * sequences.shape[-1] if isinstance(sequences, torch.Tensor) else seconds)

    monkeypatch.setattr(common, "timed", timed)


@pytest.fixture
def smoke(tmp_path_factory, capsys, clock_of_the_work):
    def run(name):
        if name not in _RUNS:
            folder = tmp_path_factory.mktemp(name)
            run_bench(importlib.import_module(f"benchmarks.{name}"), ["--smoke", "--results-dir", str(folder)],
                      quiet=True)
            written = [json.loads(line) for line in (folder / f"{name}.jsonl").read_text().splitlines()]
            _RUNS[name] = (written, capsys.readouterr().out.strip().splitlines()[-1], folder)
        return _RUNS[name][0]

    return run


@pytest.mark.parametrize("name", BENCHES)
def test_bench_smoke_writes_records_and_ends_with_json(name, smoke):
    records = smoke(name)
    assert json.loads(_RUNS[name][1])["bench"] == name
    assert records and any(r["tokens_per_s"] for r in records)
    for record in records:
        assert set(RECORD_FIELDS) <= record.keys()
        assert record["bench"] == name and record["gpu"] == "cpu" and record["command"].endswith("--smoke")


def test_decode_rows_match_transformers_tokens(smoke):
    records = smoke("decode")
    assert {r["backend"] for r in records} == {"hf_dynamic", "hf_static_compile", "hf_specdec"}
    for r in records:
        assert r["floor_tokens_per_s"] > 0
        assert r["skipped"] or r["same_tokens"], r
        assert r["skipped"] or r["first_token_ms"] > 0, r


def test_verify_and_draft_cost_ratios(smoke):
    verify = smoke("verify_cost")
    assert {r["k"] for r in verify if r["backend"] == "hf_specdec_verify"} == {1, 3}
    assert all(r["ratio_to_decode"] > 0 for r in verify)
    draft = smoke("draft_cost")
    assert {"gemma4_mtp", "step3p5_mtp"} <= {r["backend"] for r in draft}
    assert all(r["ratio"] > 0 for r in draft if not r["skipped"])


def test_verify_cost_runs_a_step3p5_target(tmp_path, clock_of_the_work):
    """The MoE shape's verify rows (the union of the experts a step's tokens select) come from the same bench."""
    import benchmarks.verify_cost as verify

    run_bench(verify, ["--smoke", "--shape", "smoke-step3p5", "--k", "3", "--batch", "1", "--results-dir",
                       str(tmp_path)], quiet=True)
    records = [json.loads(line) for line in (tmp_path / "verify_cost.jsonl").read_text().splitlines()]
    assert {(r["model_shape"], r["backend"], r["k"]) for r in records} == {
        ("smoke-step3p5", "hf_specdec", None), ("smoke-step3p5", "hf_specdec_verify", 3)}
    assert all(r["step_ms"] > 0 and r["weight_gb"] > 0 for r in records)


def test_synthetic_rows_are_flagged_not_lossless_and_accept_drafts(smoke):
    records = smoke("e2e_synthetic")
    synthetic = [r for r in records if r["backend"].endswith("_synthetic")]
    assert {r["backend"] for r in synthetic} == {"hf_specdec_mtp_synthetic", "hf_specdec_dflash_synthetic"}
    assert all(r["lossless"] is False for r in synthetic)
    assert all(r["tau"] > 1 for r in synthetic)  # random weights alone would accept ~nothing
    assert {r["k"] for r in synthetic} == {3, "auto"}
    assert all(r["lossless"] is True for r in records if r not in synthetic)


def test_assisted_and_tiny_rows_give_transformers_tokens(smoke):
    native = smoke("hf_native_assisted")
    for r in native:
        assert r.get("skipped") or r["same_tokens"], r
    assert all(r["same_tokens"] for r in native if r["backend"] == "hf_specdec_mtp")
    tiny = smoke("e2e_tiny")
    assert all(r["same_tokens"] for r in tiny)
    assert any(r["model_shape"] == "tiny-step3p5" and r["backend"] == "hf_specdec_mtp" for r in tiny)
    # num_speculative_tokens="auto" beside the fixed k, in every mode
    assert {(r["model_shape"], r["backend"]) for r in tiny if r["k"] == "auto"} == {
        ("tiny-gemma4", "hf_specdec_mtp"), ("tiny-gemma4", "hf_specdec_dflash"), ("tiny-step3p5", "hf_specdec_mtp")}


def test_tiny_rows_timed_in_turn_keep_their_median_round(monkeypatch):
    """--rounds: a member's hf_specdec rows are timed one after the other, round after round, and each row keeps
    the speed of its median round (transformers' row is timed once, first)."""
    from types import SimpleNamespace

    from benchmarks import e2e_tiny

    speeds = iter([100.0] + [10.0, 20.0] + [12.0, 18.0] + [11.0, 25.0])  # transformers, then 3 rounds of 2 rows
    timed = []

    def fake_rate(generate, batch, new_tokens, **kwargs):
        timed.append(kwargs.get("warmups"))
        return {"tokens_per_s": next(speeds), "output": generate(2)}

    monkeypatch.setattr(e2e_tiny, "decode_rate", fake_rate)
    args = SimpleNamespace(rounds=3, repeats=1, new_tokens=2, mtp_k=[2], auto=True, device="cpu")
    monkeypatch.setattr(e2e_tiny, "available_assets", lambda: ["tiny-gemma4", "tiny-gemma4-assistant"])
    rows = e2e_tiny.bench_member("tiny-gemma4", 1, args)
    assert [(r["backend"], r["k"]) for r in rows] == [("hf_dynamic", None), ("hf_specdec", None), ("hf_specdec_mtp", 2)]
    assert [r["tokens_per_s"] for r in rows] == [100.0, 11.0, 20.0]  # the median round of each (10/12/11, 20/18/25)
    assert all(r["rounds"] == 3 for r in rows[1:]) and len(timed) == 1 + 3 * 2


def test_step_mtp_rows_give_transformers_step3p7_tokens(smoke):
    """hf_native_step_mtp: every row that ran gives the greedy tokens of transformers' Step 3.7 built from the
    same weights; its MTP row runs or says why not (5.17: its MTP layers fail); the bundled model drafts at
    real tau."""
    from benchmarks.hf_native_step_mtp import PLAIN_OF

    records = smoke("hf_native_step_mtp")
    assert {r["model_shape"] for r in records} == {"tiny-step3p5", "smoke-step3p5"}
    assert [r["backend"] for r in records] == list(PLAIN_OF) * 2
    for r in records:
        assert (r["skipped"] and r["backend"] == "hf_native_mtp") or (r["same_tokens"] and r["tokens_per_s"]), r
    tiny = {r["backend"]: r for r in records if r["model_shape"] == "tiny-step3p5"}
    assert tiny["hf_specdec_mtp"]["tau"] > 1 and tiny["hf_specdec_mtp"]["speedup_vs_plain"] > 0
    assert tiny["hf_native_mtp"]["skipped"] or tiny["hf_native_mtp"]["tau"] >= 1


def test_step_mtp_bench_without_step3p7_says_so(tmp_path, monkeypatch, capsys, clock_of_the_work):
    """Where transformers has no Step 3.7, its rows say so and hf_specdec's rows still run against the tokens of
    transformers' generate on the same model."""
    from benchmarks import hf_native_step_mtp as bench

    monkeypatch.setattr(bench.step3p7, "is_available", lambda: False)
    records = run_bench(bench, ["--smoke", "--models", "tiny", "--results-dir", str(tmp_path)], quiet=True)
    native = [r for r in records if r["backend"] in ("hf_dynamic", "hf_native_mtp")]
    assert len(native) == 2 and all("has no Step 3.7" in r["skipped"] for r in native)
    assert all(r["same_tokens"] and r["tokens_per_s"] for r in records if r["backend"].startswith("hf_specdec"))


def test_report_writes_readme_with_gpu_commit_and_command(smoke, tmp_path):
    from benchmarks.report import load_records, write_report

    smoke("verify_cost")
    records = load_records(_RUNS["verify_cost"][2])
    written = write_report(records, tmp_path / "README.md", tmp_path / "plot.png")
    text = (tmp_path / "README.md").read_text()
    assert "| cpu |" in text and "`python -m benchmarks.verify_cost --smoke`" in text
    if written["plot"]:
        assert (tmp_path / "plot.png").stat().st_size > 0


def test_report_adds_the_rows_of_runs_made_apart(tmp_path):
    """``--also-run-id``: a full-depth run made apart from run_all shows in the tables beside the latest run."""
    import json

    from benchmarks.report import load_records, markdown

    rows = [dict(bench="e2e_synthetic", run_id=run, model_shape=shape, backend="hf_specdec", tokens_per_s=tps,
                 gpu="G", commit="c", command=f"cmd {shape}") for run, shape, tps in
            [("20260101T000000", "s/L60", 40.0), ("20260102T000000", "s/L12", 170.0), ("20260101T120000", "s/L12", 1.0)]]
    (tmp_path / "e2e_synthetic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    latest = load_records(tmp_path)
    assert [r["model_shape"] for r in latest] == ["s/L12"] and latest[0]["tokens_per_s"] == 170.0
    both = load_records(tmp_path, also=["20260101T000000"])
    assert [r["model_shape"] for r in both] == ["s/L12", "s/L60"]
    assert "cmd s/L60" in markdown(both)


def test_records_name_the_hf_specdec_settings_of_their_run(monkeypatch):
    """A run under an HF_SPECDEC_* environment variable (an A/B of a switch) says so in every record and in the
    tables; a run under none carries no such field."""
    from benchmarks.common import environment
    from benchmarks.report import markdown

    for name in [k for k in os.environ if k.startswith("HF_SPECDEC_")]:
        monkeypatch.delenv(name)
    assert "settings" not in environment()
    monkeypatch.setenv("HF_SPECDEC_TP_SYMM_ALL_REDUCE", "1")
    env = environment()
    assert env["settings"] == {"HF_SPECDEC_TP_SYMM_ALL_REDUCE": "1"}
    row = env | dict(bench="multi_gpu", run_id="20260101T000000", model_shape="s", placement="tp", command="cmd")
    assert "| HF_SPECDEC_TP_SYMM_ALL_REDUCE=1 |" in markdown([row])


def test_fp8_weights_rows_count_the_stored_bytes(tmp_path, clock_of_the_work):
    """``--weights fp8``: the records say so, the floor counts one byte per weight plus the block scales (below
    the dense rows' floor), hf_specdec's rows run (the MoE shape's experts in FP8 too), and transformers' own FP8
    layers, which need a GPU kernel, say why they did not."""
    import benchmarks.decode as decode
    import benchmarks.e2e_synthetic as e2e
    import benchmarks.verify_cost as verify

    args = ["--smoke", "--results-dir", str(tmp_path), "--batch", "2"]
    rows = {w: run_bench(decode, args + ["--shapes", "smoke-26b-a4b", "--weights", w, "--backends", "hf_dynamic",
                                         "hf_specdec"], quiet=True) for w in ("bf16", "fp8")}
    assert all(r["weights"] == w for w in rows for r in rows[w])
    dense, fp8 = ({r["backend"]: r for r in rows[w]} for w in ("bf16", "fp8"))
    assert fp8["hf_specdec"]["weight_gb"] < 0.6 * dense["hf_specdec"]["weight_gb"]
    # the floor per unit of the copy bandwidth each run measured (under two test processes it moves between runs)
    assert (fp8["hf_specdec"]["floor_tokens_per_s"] / fp8["hf_specdec"]["copy_gb_s"]
            > dense["hf_specdec"]["floor_tokens_per_s"] / dense["hf_specdec"]["copy_gb_s"])
    assert fp8["hf_specdec"]["same_tokens"] and fp8["hf_specdec"]["tokens_per_s"]
    assert fp8["hf_dynamic"]["skipped"] and fp8["hf_dynamic"]["same_tokens"] is None
    verify_rows = run_bench(verify, args + ["--k", "3", "--weights", "fp8"], quiet=True)
    assert {r["weights"] for r in verify_rows} == {"fp8"} and all(r["step_ms"] > 0 for r in verify_rows)
    synthetic = run_bench(e2e, args + ["--k", "3", "--alpha", "0.8", "--weights", "fp8"], quiet=True)
    assert {r["weights"] for r in synthetic} == {"fp8"}
    assert all(r["tau"] > 1 for r in synthetic if r["backend"].endswith("_synthetic"))


@pytest.mark.parametrize("weights,package", [("nf4", "bitsandbytes"), ("int4", "torchao")])
def test_4_bit_weights_rows_count_the_stored_bytes_and_compare_tokens(tmp_path, weights, package, clock_of_the_work):
    """``--weights nf4`` / ``int4``: the linears but the LM head in 4 bits (bitsandbytes' NF4 layers; torchao's int4
    weights, on the CPU in the layout that runs there), a layer's stored bytes under 0.35 of its dense fp32 bytes, the
    rows' weight bytes under the dense rows', hf_specdec's tokens equal to transformers' on the same 4-bit layers,
    and the speculative rows accepting drafts."""
    pytest.importorskip(package, reason=f"{package} is not installed (pip install {package})")
    import benchmarks.decode as decode
    import benchmarks.e2e_synthetic as e2e

    from benchmarks.shapes import stored_bytes, target_for
    from hf_specdec.generation.quantization import weight_format

    model = target_for("smoke-31b", None, "cpu", torch.float32, weights)
    assert weight_format(model) == package
    layer = model.model.layers[0].mlp.down_proj
    dense_bytes = layer.in_features * layer.out_features * 4
    assert 0 < stored_bytes(layer.weight) < 0.35 * dense_bytes  # 4 bits (+ scales, int8 codes on the CPU layout)
    args = ["--smoke", "--results-dir", str(tmp_path), "--batch", "2"]
    rows = {w: run_bench(decode, args + ["--shapes", "smoke-31b", "--weights", w, "--backends", "hf_dynamic",
                                         "hf_specdec"], quiet=True) for w in ("bf16", weights)}
    dense, quantized = ({r["backend"]: r for r in rows[w]} for w in ("bf16", weights))
    assert quantized["hf_specdec"]["weight_gb"] < dense["hf_specdec"]["weight_gb"]
    assert quantized["hf_specdec"]["same_tokens"] is True
    synthetic = run_bench(e2e, args + ["--k", "3", "--alpha", "0.8", "--weights", weights], quiet=True)
    assert {r["weights"] for r in synthetic} == {weights}
    assert all(r["tau"] > 1 for r in synthetic if r["backend"].endswith("_synthetic"))


def test_int4_weights_leave_linears_narrower_than_a_group_dense():
    """The smoke E4B shape's per-layer projection reads 8 inputs, under torchao's smallest group: it stays dense
    (``bench decode --smoke --weights int4`` raised on it), the others take int4."""
    pytest.importorskip("torchao", reason="torchao is not installed (pip install torchao)")
    from benchmarks.shapes import target_for

    model = target_for("smoke-e4b", None, "cpu", torch.float32, "int4")
    narrow = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.in_features < 32]
    assert narrow and all(type(m.weight) is torch.nn.Parameter for m in narrow)
    assert type(model.model.layers[0].mlp.down_proj.weight) is not torch.nn.Parameter


def test_floors_leave_out_a_targets_own_mtp_layers():
    """A Step 3.5 target's MTP layers (and their heads) run only when drafting: the bytes of a decode or verify step
    are those of the same model without them (they had doubled the cut shape's floor: plain decoding measured at
    "101%" of it)."""
    from benchmarks.shapes import step3p5_target, streamed_bytes_per_step

    model = step3p5_target("smoke-step3p5", None, "cpu", torch.float32)
    assert len(model.model.mtp_layers) == 3
    with_mtp = [streamed_bytes_per_step(model, 2, 40, tokens) for tokens in (1, 4)]
    mtp_bytes = sum(p.numel() * p.element_size() for layer in model.model.mtp_layers for p in layer.parameters())
    del model.model.layers[model.config.num_hidden_layers:]
    assert not model.model.mtp_layers
    without = [streamed_bytes_per_step(model, 2, 40, tokens) for tokens in (1, 4)]
    assert with_mtp == without and mtp_bytes > 0.2 * with_mtp[0]["weight_bytes"]


def test_multi_gpu_rows_decode_the_single_device_tokens(smoke):
    records = smoke("multi_gpu")
    run = {(r["model_shape"], r["placement"], r["spec_mode"]) for r in records if not r["skipped"]}
    for shape, modes in (("tiny-gemma4", ("none", "mtp", "dflash")), ("tiny-step3p5", ("none", "mtp"))):
        assert {(shape, p, m) for p in ("offload", "tp") for m in modes} <= run
    assert all(r["same_tokens"] for r in records if not r["skipped"])
    assert all("GPUs" in r["skipped"] for r in records if r["placement"] == "device_map")


def test_multi_gpu_shape_rows(tmp_path, clock_of_the_work):
    """``--shape``: a random-weight Gemma 4 target on one device and under tensor parallelism (two gloo ranks on the
    CPU), plain decoding with the one-device tokens, MTP at synthetic acceptance."""
    import benchmarks.multi_gpu as multi_gpu

    run_bench(multi_gpu, ["--shape", "smoke-31b", "--placements", "tp", "device_map", "--batch", "1",
                          "--new-tokens", "12", "--prompt", "12", "--results-dir", str(tmp_path)], quiet=True)
    records = [json.loads(line) for line in (tmp_path / "multi_gpu.jsonl").read_text().splitlines()]
    ran = {(r["placement"], r["spec_mode"]): r for r in records if not r["skipped"]}
    assert set(ran) == {(p, m) for p in ("single", "tp") for m in ("none", "mtp")}
    assert ran["tp", "none"]["same_tokens"] is True and ran["tp", "mtp"]["same_tokens"] is None
    assert ran["tp", "mtp"]["alpha"] == 0.8 and all(r["tokens_per_s"] > 0 for r in ran.values())
    assert all("GPUs" in r["skipped"] for r in records if r["placement"] == "device_map")


def test_synthetic_acceptance_draws_one_number_per_position_for_every_k():
    """Common random numbers: a draft at position p of a row is accepted iff that row's p-th uniform is below
    alpha, whatever k drafted it, and a restarted acceptance repeats its decisions."""
    from benchmarks.drafters import SyntheticAcceptance

    def run(acceptance, ks):
        acceptance.restart()
        out = []
        for k in ks:
            scores = torch.zeros(2, k + 1, 5)
            out.append(acceptance(torch.zeros(2, k, dtype=torch.long), None, scores)[0].tolist())
        return out

    acceptance = SyntheticAcceptance(0.7, seed=3)
    ks = [1, 4, 2, 7, 3, 5, 1, 6] * 4
    decisions = run(acceptance, ks)
    assert run(acceptance, ks) == decisions
    uniform = acceptance._uniform
    for row in range(2):
        position = 0
        for k, accepted in zip(ks, decisions):
            expected = 0
            while expected < k and uniform[row, position + expected] < 0.7:
                expected += 1
            assert accepted[row] == expected
            position += expected + 1
    assert sum(sum(d) for d in decisions) > 0


def test_synthetic_acceptance_restarts_on_the_draws_of_another_seed():
    """restart(seed) redraws the uniforms in place (a graph that captured them reads the new ones), as a fresh
    acceptance of that seed draws them, and decides as that one does; restart() keeps the seed's draws."""
    from benchmarks.drafters import SyntheticAcceptance

    def decide(acceptance, k=6):
        return acceptance(torch.zeros(3, k, dtype=torch.long), None, torch.zeros(3, k + 1, 5))[0].tolist()

    acceptance = SyntheticAcceptance(0.6)
    first = decide(acceptance)
    state = acceptance._uniform
    acceptance.restart(seed=4)
    fresh = SyntheticAcceptance(0.6, seed=4)
    assert decide(acceptance) == decide(fresh) != first
    assert acceptance._uniform is state and torch.equal(state, fresh._uniform)
    acceptance.restart()
    assert decide(acceptance) == decide(fresh.__class__(0.6, seed=4))
    acceptance.restart(seed=0)
    assert decide(acceptance) == first


def test_decode_rate_sets_up_each_timed_pair(monkeypatch):
    """before_pair(i) runs before the i-th timed pair (its two calls), after the warm-ups."""
    from benchmarks import common

    calls = []
    monkeypatch.setattr(common, "timed", lambda fn: (fn(), 2.0 if calls[-1] == ("call", 9) else 1.0))
    common.decode_rate(lambda n: calls.append(("call", n)), batch=1, new_tokens=9, repeats=3, warmups=2,
                       before_pair=lambda i: calls.append(("pair", i)))
    assert calls == [("call", 1), ("call", 9), ("call", 9)] + [
        entry for i in range(3) for entry in (("pair", i), ("call", 1), ("call", 9))]


def test_decode_rate_pools_pairs_on_request(monkeypatch):
    """pooled: the pairs' tokens over their summed times (not the median pair's rate), every pair's snapshot."""
    from benchmarks import common

    times = iter([1.0, 4.0, 1.0, 2.0, 0.5, 2.0])  # three timed pairs (1 token, 9 tokens): 3, 1 and 1.5 s apart
    monkeypatch.setattr(common, "timed", lambda fn: (fn(), next(times)))
    snapshots = iter(["a", "b", "c"])
    pooled = common.decode_rate(lambda n: n, batch=2, new_tokens=9, repeats=3, snapshot=lambda: next(snapshots),
                                pooled=True)
    assert pooled["tokens_per_s"] == pytest.approx(3 * 2 * 8 / (3 + 1 + 1.5)) and pooled["snapshots"] == ["a", "b", "c"]


def test_synthetic_rows_pool_their_draws_with_seeds(monkeypatch):
    """--seeds: a row that draws acceptances gives each timed pair a seed of its own (restart(seed=i) before pair i)
    and pools them, its tau the harmonic mean of the calls' (their tokens over their forwards); a plain row keeps the
    median pair; fewer than two repeats are refused."""
    from types import SimpleNamespace

    from benchmarks import e2e_synthetic
    from benchmarks.drafters import SyntheticAcceptance

    seen = []

    def fake_rate(generate, batch, new_tokens, **kwargs):
        seen.append(kwargs)
        if kwargs["before_pair"] is not None:
            for i in range(3):
                kwargs["before_pair"](i)
        return {"tokens_per_s": 1.0, "snapshot": 2.0, "snapshots": [2.0, 4.0, 4.0]}

    monkeypatch.setattr(e2e_synthetic, "decode_rate", fake_rate)
    target = SimpleNamespace(generate=lambda *a, **k: None)
    args = SimpleNamespace(seeds=True, repeats=3, new_tokens=4)
    acceptance = SyntheticAcceptance(0.8)
    seeds = []
    monkeypatch.setattr(acceptance, "restart", lambda seed=None: seeds.append(seed))
    ids = torch.zeros(1, 2, dtype=torch.long)
    drafted = e2e_synthetic._speed(target, ids, args, {"acceptance": acceptance})
    plain = e2e_synthetic._speed(target, ids, args, {})
    assert seen[0]["pooled"] and seeds == [0, 1, 2] and not seen[1]["pooled"] and seen[1]["before_pair"] is None
    assert drafted["tau"] == 1.0 and plain["tau"] == 1.0  # (not enabled: no hf_specdec stats to read)
    target._hf_specdec = object()
    assert e2e_synthetic._speed(target, ids, args, {"acceptance": acceptance})["tau"] == pytest.approx(3.0)
    with pytest.raises(SystemExit, match="give --repeats 2 or more"):
        e2e_synthetic.run(SimpleNamespace(seeds=True, repeats=1), None)


def test_a_rate_hidden_by_the_calls_other_work_is_refused(monkeypatch):
    """When generating N tokens took no longer than generating 1 (a slow, noisy prefill hides the decode), the rate
    is refused with the fix, not reported as an absurd number; a long call that is slower gives the rate."""
    from benchmarks import common

    seconds = {1: 0.5, 64: 0.4}
    monkeypatch.setattr(common, "timed", lambda fn: (fn(), seconds[fn()]))
    with pytest.raises(RuntimeError, match="raise --new-tokens or --repeats"):
        common.decode_rate(lambda n: n, batch=8, new_tokens=64, repeats=3)
    seconds[64] = 0.563
    rate = common.decode_rate(lambda n: n, batch=8, new_tokens=64)
    # the rate of the decode alone; the time to the first token is the call of one token
    assert rate["tokens_per_s"] == pytest.approx(8 * 63 / 0.063) and rate["first_token_ms"] == pytest.approx(500)


def test_the_time_to_the_first_token_is_the_median_of_the_pairs_calls(monkeypatch):
    """first_token_ms is the median t(1) over the repeats, not the t(1) of the pair whose decode is the median
    (here that pair's t(1) is the slowest call)."""
    from benchmarks import common

    calls = iter([(1, 0.9), (64, 1.0), (1, 0.3), (64, 0.5), (1, 0.5), (64, 0.55)])  # decodes 0.1, 0.2, 0.05 s

    def timed(fn):
        n, seconds = next(calls)
        assert fn() == n
        return n, seconds

    monkeypatch.setattr(common, "timed", timed)
    rate = common.decode_rate(lambda n: n, batch=1, new_tokens=64, repeats=3)
    assert rate["tokens_per_s"] == pytest.approx(63 / 0.1) and rate["first_token_ms"] == pytest.approx(500)


@pytest.mark.parametrize("signal", ["SIGABRT", "SIGSEGV"])
def test_multi_gpu_reruns_gloo_ranks_once_after_an_abort(tmp_path, monkeypatch, signal, clock_of_the_work):
    """CPU gloo ranks that died on SIGABRT (an abort seen now and then on a loaded 2-core machine) run again, up to
    CPU_ABORT_RERUNS times; any other death, or an abort past the reruns, is the bench's error. (The real run after the
    simulated abort keeps one rerun of its own: that abort happens in ~1 run of 12 here.)"""
    import torch.multiprocessing as mp

    import benchmarks.multi_gpu as multi_gpu

    spawned = []
    start = mp.start_processes

    def abort():
        raise mp.ProcessExitedException("test: rank 1 died", error_index=1, error_pid=0, exit_code=-6,
                                        signal_name=signal)

    def dies_first(*args, **kwargs):
        spawned.append(1)
        if len(spawned) == 1:
            abort()
        return start(*args, **kwargs)

    monkeypatch.setattr(mp, "start_processes", dies_first)
    # (12 new tokens: with 4 the one-process row's decode, 3 steps, once took less than the noise of its prefill on a
    # loaded CI machine, and the bench rightly refused to give a rate; the work's clock now times this process's calls,
    # and the ranks, which it does not reach, decode 11 steps)
    argv = ["--shape", "smoke-31b", "--placements", "tp", "--modes", "none", "--batch", "1", "--new-tokens", "12",
            "--prompt", "12", "--results-dir", str(tmp_path)]
    if signal != "SIGABRT":
        with pytest.raises(mp.ProcessExitedException):
            run_bench(multi_gpu, argv, quiet=True)
        assert spawned == [1]
        return
    # an abort past the reruns is the error (every spawn aborts here, none runs)
    monkeypatch.setattr(mp, "start_processes", lambda *a, **kw: spawned.append(1) or abort())
    with pytest.raises(mp.ProcessExitedException):
        run_bench(multi_gpu, argv, quiet=True)
    assert len(spawned) == 1 + multi_gpu.CPU_ABORT_RERUNS
    spawned.clear()
    monkeypatch.setattr(mp, "start_processes", dies_first)
    monkeypatch.setattr(multi_gpu, "CPU_ABORT_RERUNS", 2)  # the simulated abort takes one, a real one the other
    run_bench(multi_gpu, argv, quiet=True)
    records = [json.loads(line) for line in (tmp_path / "multi_gpu.jsonl").read_text().splitlines()]
    assert len(spawned) in (2, 3) and any(r["placement"] == "tp" and not r["skipped"] for r in records)


def test_ab_first_token_times_both_in_turn_and_leaves_the_model_as_it_found_it(capsys, monkeypatch):
    """``benchmarks.ab_first_token``: per round one timed one-token call with hf_specdec enabled and one without, in
    that order, each after an untimed call of ``--after-new-tokens``; the model is left disabled; a row per (shape,
    prompt) and the table."""
    import benchmarks.ab_first_token as ab
    from benchmarks.shapes import target_for

    calls, models, original = [], set(), ab.first_token_ms
    times = {True: iter([30.0, 10.0, 20.0, 40.0]), False: iter([50.0, 70.0, 60.0, 80.0])}  # per timed call

    def timing(model, ids, new_tokens=1):
        enabled = hasattr(model, "_hf_specdec")
        calls.append((enabled, new_tokens))  # enabled, and the call's length
        models.add(model)
        original(model, ids, new_tokens)
        return next(times[enabled]) if new_tokens == 1 else 0.0

    monkeypatch.setattr(ab, "first_token_ms", timing)
    built = []
    monkeypatch.setattr(ab, "target_for", lambda *a: built.append(a[:2]) or target_for(*a))
    assert ab.main(["--shapes", "smoke-e4b:3", "--prompts", "5", "9", "--rounds", "2", "--after-new-tokens", "3",
                    "--device", "cpu"]) == 0
    mine, base = [(True, 3), (True, 1)], [(False, 3), (False, 1)]
    assert built == [("smoke-e4b", 3)] and calls == (mine + base + base + mine) * 2  # ABBA, two prompts
    assert len(models) == 1 and not hasattr(models.pop(), "_hf_specdec")
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    assert [(r["model_shape"], r["prompt"]) for r in rows] == [("smoke-e4b:3", 5), ("smoke-e4b:3", 9)]
    assert [(r["hf_specdec_all"], r["transformers_all"]) for r in rows] == [([30.0, 10.0], [50.0, 70.0]),
                                                                           ([20.0, 40.0], [60.0, 80.0])]
    assert [(r["hf_specdec_ms"], r["transformers_ms"], r["speedup"]) for r in rows] == [(20.0, 60.0, 3.0),
                                                                                       (30.0, 70.0, 2.333)]
    assert any(line.startswith("smoke-e4b:3") for line in lines)


def test_ab_decode_times_each_value_in_turn_and_restores_the_attribute(capsys, clock_of_the_work):
    """``benchmarks.ab_decode``: one row per (round, value), the tokens of every value compared with the first's,
    the attribute set back afterwards; a malformed ``--set`` is refused with the form it takes."""
    import benchmarks.ab_decode as ab
    from hf_specdec.kernels import skinny_gemm

    before = skinny_gemm.SPLIT_K
    seen = []
    original = ab.measure_hf_specdec

    def measuring(model, ids, args):  # which value each measurement ran under
        seen.append(skinny_gemm.SPLIT_K)
        return original(model, ids, args)

    ab.measure_hf_specdec = measuring
    try:
        assert ab.main(["--set", "hf_specdec.kernels.skinny_gemm.SPLIT_K=False,True", "--shapes", "smoke-31b:2",
                        "--batch", "2", "--rounds", "2", "--prompt", "6", "--new-tokens", "4", "--repeats", "1",
                        "--device", "cpu"]) == 0
    finally:
        ab.measure_hf_specdec = original
    assert seen == [False, True, False, True] and skinny_gemm.SPLIT_K == before
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines if line.startswith('{"shape"')]
    assert [(r["value"], r["round"]) for r in rows] == [("False", 0), ("True", 0), ("False", 1), ("True", 1)]
    assert all(r["same_tokens_as_first"] and r["tokens_per_s"] > 0 and r["shape"] == "smoke-31b:2" for r in rows)
    assert any(line.startswith("smoke-31b:2") and line.rstrip().endswith("True") for line in lines)  # the table
    for bad, message in (("SPLIT_K=False,True", "MODULE.ATTRIBUTE=V1,V2"),
                         ("hf_specdec.kernels.skinny_gemm.NOPE=1,2", "has no attribute"),
                         ("hf_specdec.kernels.skinny_gemm.SPLIT_K=yes,no", "Python literals"),
                         ("hf_specdec.kernels.skinny_gemm.SPLIT_K=True", "two values or more")):
        with pytest.raises(SystemExit, match=message):
            ab.main(["--set", bad, "--device", "cpu"])


def test_moe_kernel_ab_times_each_value_in_turn_and_restores_the_attribute(capsys, monkeypatch):
    """``benchmarks.moe_kernel_ab``: per token count and round, each value in turn, its output compared with the first
    value's, the attribute set back afterwards; without a GPU it refuses, naming what it needs. The layer and its
    graph timing stand in for the GPU's (the bench's own plumbing is what runs)."""
    import benchmarks.moe_kernel_ab as ab
    from hf_specdec.kernels import fp8_moe

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        ab.main(["--set", "hf_specdec.kernels.fp8_moe.W8A8_STACKED_GATE_UP=False,True"])
    seen = []

    class Layer:  # output 1 + the setting: the second value's differs from the first's by 1
        def __init__(self, name, weights):
            assert (name, weights) == ("gemma4-26b-a4b", "w8a8")

        def inputs(self, tokens):
            return [torch.zeros(tokens, 4), torch.zeros(tokens, 2, dtype=torch.long), torch.ones(tokens, 2)]

        def call(self, args):
            seen.append(fp8_moe.W8A8_STACKED_GATE_UP)
            return args[0] + 1.0 + float(fp8_moe.W8A8_STACKED_GATE_UP)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a GPU")
    monkeypatch.setattr(ab, "Layer", Layer)
    monkeypatch.setattr(ab, "graph_time", lambda layer, args, fn: (fn(), ([3.0, 1.0, 2.0], [2]))[1])
    before = fp8_moe.W8A8_STACKED_GATE_UP
    assert ab.main(["--set", "hf_specdec.kernels.fp8_moe.W8A8_STACKED_GATE_UP=False,True", "--tokens", "1", "4",
                    "--rounds", "2"]) == 0
    assert fp8_moe.W8A8_STACKED_GATE_UP == before
    assert seen == [False, False, True, True] * 4  # each timing: one call for the output, one under the timer
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines if line.startswith('{"tokens"')]
    assert [(r["tokens"], r["value"], r["round"]) for r in rows] == [
        (t, v, r) for t in (1, 4) for r in (0, 1) for v in ("False", "True")]
    assert all(r["median_us"] == 2.0 for r in rows)
    assert [r["max_abs_diff_from_first"] for r in rows] == [0.0, 1.0] * 4
    with pytest.raises(SystemExit, match="MODULE.ATTRIBUTE=V1,V2"):
        ab.main(["--set", "W8A8_STACKED_GATE_UP=False,True"])


def test_ab_spec_times_each_mode_under_each_value_in_turn(capsys, monkeypatch, clock_of_the_work):
    """``benchmarks.ab_spec``: per round, each value in turn, plain and every fixed-k mode of the member with the
    graphs released between values, the tokens compared with the first value's, the attribute set back afterwards."""
    import benchmarks.ab_spec as ab
    from hf_specdec.kernels import skinny_gemm

    if "tiny-step3p5" not in available_assets():
        pytest.skip("the bundled tiny Step 3.5 is not installed")
    before = skinny_gemm.SPLIT_K
    seen, original = [], ab._measure

    def measuring(model, inputs, batch, extra, case, *rest):  # which value each measurement ran under
        seen.append((case, skinny_gemm.SPLIT_K))
        return original(model, inputs, batch, extra, case, *rest)

    monkeypatch.setattr(ab, "_measure", measuring)
    assert ab.main(["--set", "hf_specdec.kernels.skinny_gemm.SPLIT_K=False,True", "--members", "tiny-step3p5",
                    "--batch", "2", "--rounds", "2", "--new-tokens", "3", "--repeats", "1", "--device", "cpu"]) == 0
    cases = ["tiny-step3p5 plain"] + [f"tiny-step3p5 mtp k={k}" for k in (1, 2, 3)]
    assert seen == [(case, value) for _ in range(2) for value in (False, True) for case in cases]
    assert skinny_gemm.SPLIT_K == before
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines if line.startswith('{"case"')]
    assert [(r["case"], r["value"], r["round"]) for r in rows] == [
        (case, value, round_) for round_ in range(2) for value in ("False", "True") for case in cases]
    assert all(r["same_tokens_as_first"] and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["tau"] > 1 for r in rows if "mtp" in r["case"])
    assert sum(line.startswith("tiny-step3p5") and line.rstrip().endswith("True") for line in lines) == 4  # table
    with pytest.raises(SystemExit, match="ab_spec: --set takes MODULE.ATTRIBUTE=V1,V2"):
        ab.main(["--set", "SPLIT_K=False,True", "--device", "cpu"])


def test_profile_spec_host_rounds_profiles_the_rounds_only(capsys):
    """``benchmarks.profile_spec --host-rounds``: the rounds' host work alone (the loop's step), per round, beside
    the phases and the op table; the prefill's forward is not among its functions."""
    import re

    import benchmarks.profile_spec as profile_spec

    if "tiny-gemma4-assistant" not in available_assets():
        pytest.skip("the bundled tiny Gemma 4 assistant is not installed")
    assert profile_spec.main(["--bundled", "mtp", "--device", "cpu", "--batch", "1", "--k", "2", "--new-tokens", "6",
                              "--host-rounds", "1", "--rows", "40"]) == 0
    out = capsys.readouterr().out
    head = re.search(r"host work of the rounds: (\d+) us a round unprofiled \((\d+) rounds in 1 calls\); under "
                     r"cProfile (\d+) Python calls", out)
    assert head is not None and int(head[1]) > 0 and int(head[2]) >= 1 and int(head[3]) > 0
    listing = out[head.end():out.index("kernels of one call")]
    assert "speculative.py" in listing and "(step)" in listing
    assert "(prefill)" not in listing  # speculative.SpeculativeLoop.prefill runs outside the rounds


def test_profile_spec_step3p5_defaults_to_its_mtp_layers(capsys):
    """``profile_spec --bundled step3p5`` without ``--k`` drafts one token per MTP layer of the checkpoint (the
    default of 7 is more than it has)."""
    import benchmarks.profile_spec as profile_spec

    if "tiny-step3p5" not in available_assets():
        pytest.skip("the bundled tiny Step 3.5 is not installed")
    assert profile_spec.main(["--bundled", "step3p5", "--device", "cpu", "--batch", "1", "--new-tokens", "4",
                              "--rows", "5"]) == 0
    assert capsys.readouterr().out.startswith("batch 1, k 3, step3p5")


@pytest.mark.usefixtures("cpu_drafts_ahead")  # the call that waits drafts its rounds as the one run ahead
def test_synthetic_acceptance_runs_ahead_with_its_decision_inside_the_verify(monkeypatch):
    """The synthetic acceptance takes its decision with the verify forward (inside its graph on the GPU) and lets a
    greedy call run ahead, as users' greedy calls do: same tokens and rounds as its decision taken after the forward
    in a call that waits for every round, and rounds were queued ahead."""
    import hf_specdec
    from benchmarks.drafters import SyntheticAcceptance
    from hf_specdec.generation import sampling, speculative
    from hf_specdec.models.gemma4.mtp_drafter import Gemma4MTPDraftRunner
    from tests import bundled

    model, extra, _ = bundled.mode("gemma_mtp")
    ids, mask = bundled.batch(3)
    acceptance = SyntheticAcceptance(0.7, seed=5)
    queued = []
    finish = speculative.SpeculativeLoop._finish
    monkeypatch.setattr(speculative.SpeculativeLoop, "_finish",
                        lambda self, verified, in_flight=None: (queued.append(in_flight is not None),
                                                                finish(self, verified, in_flight))[1])
    # (rows stay in the batch when they stop, as on the GPU: the uniforms are by row index)
    monkeypatch.setattr(Gemma4MTPDraftRunner, "drops_rows", False)
    runs = []
    for devices, with_forward in (((), False), (("cuda", "cpu"), True)):
        monkeypatch.setattr(speculative, "RUN_AHEAD_DEVICES", devices)
        monkeypatch.setattr(sampling, "SELECT_WITH_FORWARD", with_forward)
        queued.clear()
        acceptance.restart()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None,
                             pad_token_id=0, acceptance=acceptance, **extra)
        stats = hf_specdec.last_generation_stats(model)
        runs.append((out, stats.num_target_forwards, stats.acceptance_histogram, sum(queued)))
    (out, forwards, histogram, ahead), (out_ahead, forwards_ahead, histogram_ahead, ahead_ahead) = runs
    assert torch.equal(out, out_ahead) and (forwards, histogram) == (forwards_ahead, histogram_ahead)
    assert ahead == 0 and ahead_ahead >= forwards - 3 > 0 and 0 < sum(histogram[1:]) < sum(histogram)


def test_step_timeline_reads_steps_layers_and_copies_from_the_kernels_timeline():
    """``benchmarks.step_timeline``'s reading of a trace (the GPU run profiles a real one): steps between the forwards'
    first kernels, the first layer's start and each layer's span, copies between GPUs and kernels a step per device."""
    from benchmarks.step_timeline import LAYER_MARKER, STEP_MARKER, timeline

    def kernel(name, ts, pid=0, cat="kernel"):
        return dict(ph="X", cat=cat, name=name, ts=ts, dur=1.0, pid=pid)

    events = [dict(ph="X", cat="cpu_op", name=STEP_MARKER, ts=5.0, dur=1.0, pid=0)]  # a host event: not a step
    for step in range(9):
        t = 1000.0 * step + (3.0 if step % 2 else 0.0)  # steps of 997 / 1003 us
        events += [kernel(STEP_MARKER, t), kernel(LAYER_MARKER, t + 60), kernel("gemm", t + 70),
                   kernel("norm", t + 70.5),  # launched early, overlapping the gemm: it adds 0.5 us
                   kernel(LAYER_MARKER, t + 320, pid=1), kernel("Memcpy PtoP (Device -> Device)", t + 310, 0,
                                                                "gpu_memcpy"), kernel(LAYER_MARKER, t + 600, pid=1)]
    figures = timeline(events, skip=2)
    assert figures["step_us"] == 1000.0  # the median of 1003, 997, ... (the steps after the two skipped)
    assert figures["first_layer_us"] == 60.0 and figures["layer_us"] == [260.0, 280.0]
    assert figures["peer_copies"] == 1 and figures["kernels"] == {0: 4.0, 1: 2.0}
    # on the markers' device: the marker, the first layer's kernel, the gemm, the norm (0.5 us past the gemm's end)
    # and the copy; each kernel charged for what it adds to the busy time, not for its whole span
    assert figures["busy_us"] == 4.5 and figures["top"] == {"gemm": 1.0, STEP_MARKER: 1.0, LAYER_MARKER: 1.0,
                                                           "norm": 0.5, "Memcpy PtoP (Device -> Device)": 1.0}
    assert figures["layer_kernels"] == []
    detail = timeline(events, skip=2, detail_layer=0)["layer_kernels"]  # the first layer's kernels on device 0
    assert detail == [(LAYER_MARKER, 0.0, 1.0, 1.0), ("gemm", 10.0, 1.0, 1.0), ("norm", 10.5, 1.0, 0.5),
                      ("Memcpy PtoP (Device -> Device)", 250.0, 1.0, 1.0)]
    with pytest.raises(ValueError, match="generate more tokens"):
        timeline(events[:12], skip=2)


def test_fixed_drafter_runs_ahead_as_the_bundled_drafters_do(monkeypatch):
    """verify_cost's drafter: where the loop runs greedy rounds ahead (the GPU; here the CPU, let in, drafting before
    the read-back as on the GPU), its rounds are queued before the host reads the round before, as the bundled
    drafters' are (``ahead``), or each waits for it and drafts after the commit (``ahead=False``, ``--no-ahead``).
    Either way the call gives plain greedy decoding's tokens, and its rounds accept the same drafts."""
    import hf_specdec
    from benchmarks.drafters import FixedDrafter
    from hf_specdec.generation import speculative
    from tests import bundled

    model, _, reference = bundled.mode("plain")
    ids, mask = bundled.batch(3)
    queued, drafted_ahead = [], []
    finish = speculative.SpeculativeLoop._finish
    monkeypatch.setattr(speculative.SpeculativeLoop, "_finish",
                        lambda self, verified, in_flight=None: (queued.append(in_flight is not None),
                                                                finish(self, verified, in_flight))[1])
    propose_ahead = FixedDrafter.propose_ahead
    monkeypatch.setattr(FixedDrafter, "propose_ahead",
                        lambda self, *args: drafted_ahead.append(propose_ahead(self, *args)) or drafted_ahead[-1])
    monkeypatch.setattr(speculative, "RUN_AHEAD_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(speculative, "CPU_DRAFTS_AFTER_COMMIT", False)
    kwargs = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    expected = reference.generate(ids, **kwargs)
    runs = {}
    for ahead in (True, False):
        queued.clear()
        drafted_ahead.clear()
        out = model.generate(ids, assistant_model=FixedDrafter(3, ahead=ahead), **kwargs)
        assert torch.equal(out, expected)
        stats = hf_specdec.last_generation_stats(model)
        runs[ahead] = (stats.num_target_forwards, list(stats.acceptance_histogram), sum(queued),
                       [d is not None for d in drafted_ahead])
    (forwards, histogram, queued_ahead, made), (forwards_waiting, histogram_waiting, queued_waiting, made_waiting) = (
        runs[True], runs[False])
    assert (forwards, histogram) == (forwards_waiting, histogram_waiting) and 0 < sum(histogram[1:])
    assert queued_ahead >= forwards - 3 > 0 and all(made) and len(made) >= forwards - 3
    assert queued_waiting == 0 and made_waiting and not any(made_waiting)


def test_gpt_oss_shape_decodes_transformers_tokens_and_counts_its_active_experts(tmp_path, clock_of_the_work):
    """The gpt-oss shape (sinks, alternating windows, experts with biases): decode rows with transformers' tokens, and
    a floor that reads the selected experts' weights and biases only, and a window's keys on sliding layers only."""
    import benchmarks.decode as decode
    from benchmarks.shapes import gpt_oss_target, streamed_bytes_per_step

    run_bench(decode, ["--smoke", "--shapes", "smoke-gpt-oss", "--batch", "1", "--backends", "hf_dynamic",
                       "hf_specdec", "--results-dir", str(tmp_path)], quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "decode.jsonl").read_text().splitlines()]
    assert {r["backend"] for r in rows} == {"hf_dynamic", "hf_specdec"} and all(r["same_tokens"] for r in rows)
    model = gpt_oss_target("smoke-gpt-oss", None, "cpu", torch.float32)
    config = model.config
    one = streamed_bytes_per_step(model, 1, 40)
    experts = [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]
    expert_bytes = sum(p.numel() * p.element_size() for m in experts for p in m.parameters())
    everything = sum(p.numel() * p.element_size() for p in model.parameters())
    share = config.num_experts_per_tok / config.num_local_experts
    embedding = model.get_input_embeddings().weight
    read = everything - expert_bytes * (1 - share) - embedding.numel() * embedding.element_size() \
        + embedding.shape[1] * embedding.element_size()
    assert one["weight_bytes"] == pytest.approx(read, rel=1e-6)
    window, full = config.sliding_window, 40
    per_layer = 2 * config.num_key_value_heads * config.head_dim * 4
    assert one["kv_bytes"] == per_layer * sum(window if t == "sliding_attention" else full
                                              for t in config.layer_types)
