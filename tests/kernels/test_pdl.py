"""Programmatic dependent launch: a kernel launched with ``launch_pdl=True`` may start before the kernel ahead of
it ends, so each must wait (``pdl_wait``) before it touches memory another kernel writes or reads. The source
checks hold every kernel of the package to that; the GPU test runs a chain of dependent kernels in a CUDA graph
with and without PDL and compares the bits."""

import ast
import inspect
import pathlib

import pytest
import torch

import hf_specdec.kernels as kernels_package
from hf_specdec.kernels import _dispatch
from hf_specdec.kernels._dispatch import pdl_args, use_pdl

KERNEL_FILES = sorted(pathlib.Path(inspect.getfile(kernels_package)).parent.glob("*.py"))
MEMORY_OPS = {"load", "store", "atomic_add", "atomic_cas", "atomic_xchg", "atomic_max", "atomic_min"}


def _jit_kernels(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel") and any(
                ast.unparse(d) == "triton.jit" for d in node.decorator_list):
            yield node


def _calls(node):
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _name(call) -> str:
    return ast.unparse(call.func)


def test_every_kernel_waits_before_it_touches_memory():
    kernels = 0
    for path in KERNEL_FILES:
        for fn in _jit_kernels(ast.parse(path.read_text())):
            kernels += 1
            where = f"{path.name}:{fn.name}"
            assert "PDL" in [a.arg for a in fn.args.args], f"{where} takes no PDL argument"
            body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
            waits = [i for i, s in enumerate(body) if any(_name(c) == "pdl_wait" for c in _calls(s))]
            assert waits, f"{where} never calls pdl_wait(PDL)"
            first = waits[0]
            assert isinstance(body[first], ast.Expr) and _name(body[first].value) == "pdl_wait", \
                f"{where}: pdl_wait must be a statement of the kernel's body, not inside a branch"
            before = [_name(c) for s in body[:first] for c in _calls(s)]
            touching = [n for n in before if n.split(".")[-1] in MEMORY_OPS
                        or not (n.startswith("tl.") or n.endswith(".to"))]
            assert not touching, f"{where} calls {touching} before pdl_wait (only index arithmetic may come first)"
    assert kernels >= 15


def test_every_launch_passes_the_pdl_arguments():
    launches = 0
    for path in KERNEL_FILES:
        for call in _calls(ast.parse(path.read_text())):
            if isinstance(call.func, ast.Subscript) and ast.unparse(call.func.value).endswith("_kernel"):
                launches += 1
                keywords = [ast.unparse(k) for k in call.keywords]
                assert any(k.startswith("**pdl_args(") for k in keywords), \
                    f"{path.name}: {ast.unparse(call.func.value)} launched without **pdl_args(...)"
    assert launches >= 15


def test_pdl_only_for_cuda_tensors_and_switchable(monkeypatch):
    assert pdl_args(torch.zeros(1)) == {"PDL": False, "launch_pdl": False}
    monkeypatch.setattr(_dispatch, "PDL", False)
    assert not use_pdl(torch.zeros(1))
    if torch.cuda.is_available():
        assert not use_pdl(torch.zeros(1, device="cuda"))


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
                    reason="programmatic dependent launch needs a Hopper-class GPU")
def test_a_chain_of_dependent_kernels_in_a_graph_gives_the_serialised_bits(monkeypatch):
    """40 dependent launches of five kernels (norms, the few-row GEMM, the gated activation, a residual add), each
    reading what the one before wrote, in one CUDA graph: with PDL the same bits as fully serialised launches, and
    the same again on new inputs copied into the graph's buffers (a kernel that overtook the one ahead would read
    a stale or half-written row)."""
    from hf_specdec.kernels.gelu_mul import gelu_tanh_mul
    from hf_specdec.kernels.rms_norm import norm_add, rms_norm
    from hf_specdec.kernels.skinny_gemm import skinny_linear

    assert use_pdl(torch.zeros(1, device="cuda"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden, inter = 1024, 4096
    w_gate_up = torch.randn(2 * inter, hidden, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.03
    w_down = torch.randn(hidden, inter, device="cuda", generator=gen, dtype=torch.bfloat16) * 0.02
    norm_w = torch.randn(hidden, device="cuda", generator=gen, dtype=torch.bfloat16)
    x = torch.randn(4, hidden, device="cuda", generator=gen, dtype=torch.bfloat16)

    def chain(h):
        for _ in range(8):
            gate, up = skinny_linear(rms_norm(h, norm_w, 1e-6), w_gate_up).chunk(2, dim=-1)
            h, _ = norm_add(skinny_linear(gelu_tanh_mul(gate, up), w_down), h, norm_w, 1e-6)
        return h

    def graphed(pdl: bool):
        monkeypatch.setattr(_dispatch, "PDL", pdl)
        static = x.clone()
        chain(static)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = chain(static)
        results = []
        for seed in (1, 2):
            static.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed),
                                     dtype=x.dtype))
            graph.replay()
            results.append(out.clone())
        return results, chain(static)

    (serial, eager_serial) = graphed(False)
    (overlapped, eager_overlapped) = graphed(True)
    for a, b in zip(serial, overlapped):
        assert torch.equal(a, b)
    assert torch.equal(eager_serial, eager_overlapped) and torch.equal(serial[1], eager_serial)
    assert not torch.equal(serial[0], serial[1])
