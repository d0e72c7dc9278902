"""`distopt bench` with the Muon configurations on a tiny run: distopt's Muon (each matrix
owned and orthogonalised by one rank), torch DDP + Muon on every rank, and Moonshot's gathered
Muon train the same steps; the Newton-Schulz runs and the bytes they send are counted."""

from __future__ import annotations

import json

import pytest
import torch

from distopt.bench import main
from distopt.bench.models import build_model
from distopt.bench.muon import muon_state_bytes
from distopt.bench.systems import wire_bytes
from distopt.optim.recipes import hidden_matrices

pytestmark = pytest.mark.slow

D = 2
SYSTEMS = ["distopt-muon", "ddp-muon", "gather-muon"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-muon")
    code = main([
        "--nproc", str(D), "--model", "gpt-tiny", "--systems", *SYSTEMS, "--steps", "2",
        "--warmup", "1", "--repeat", "1", "--batch-size", "1", "--seq-len", "8",
        "--out", str(out),
    ])
    with open(out / "bench.json") as f:
        data = json.load(f)
    return code, {r["config"]["system"]: r for r in data["results"]}


def _matrices() -> int:
    with torch.device("meta"):
        matrices, _ = hidden_matrices(build_model("gpt-tiny", 8).module)
    return len(matrices)


def test_the_three_train_the_same_steps(bench):
    code, results = bench
    assert code == 0 and sorted(results) == sorted(SYSTEMS)
    ref = results["ddp-muon"]
    for name, r in results.items():
        # Same grads (averaged in another order), same momentum, same Newton-Schulz input: on
        # this model the three end on the same bits. The bound leaves room for the last bits
        # of the sums, which bf16 Newton-Schulz may round apart elsewhere, and still catches a
        # checksum read while a gather is in flight (6e-4 apart).
        assert r["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-6), name
        assert r["checksum"] == pytest.approx(ref["checksum"], rel=1e-6), name


def test_newton_schulz_runs_per_rank(bench):
    _, results = bench
    matrices = _matrices()
    assert matrices == 8  # two blocks of four
    # distopt: once per matrix across the group, on its owner.
    owned = results["distopt-muon"]["newton_schulz_per_step"]
    assert sum(owned) == matrices and all(0 < n < matrices for n in owned)
    # DDP: every matrix on every rank.
    assert results["ddp-muon"]["newton_schulz_per_step"] == [matrices] * D
    # Gathered: every matrix on every rank whose shard holds part of it, so at least once each.
    gathered = results["gather-muon"]["newton_schulz_per_step"]
    assert sum(gathered) >= matrices and all(n <= matrices for n in gathered)


def test_bytes_sent_per_step(bench):
    _, results = bench
    n_bytes = 4 * results["ddp-muon"]["num_params"]
    # DDP: one all-reduce of every grad.
    assert results["ddp-muon"]["payload_bytes_per_step"] == {"all_reduce": n_bytes}
    # distopt: one reduce-scatter and one all-gather per bucket of the padded buffer, as with
    # AdamW: d - 1 point-to-point sends of one rank's chunk each on gloo.
    r = results["distopt-muon"]
    padded = r["distopt_comm"]["payload_bytes_per_step"]["reduce_scatter"]
    assert n_bytes <= padded
    # And the small all-gather of what p.grad reads ([Note: p.grad under distopt]): 2 fp64
    # numbers per param tensor from each rank, under 1% of the grads even for this small model.
    small = r["distopt_comm"]["payload_bytes_per_step"]["agree_grad_statistics"]
    assert small % (D * 2 * 8) == 0 and 0 < small < 1e-2 * n_bytes
    assert r["payload_bytes_per_step"] == {"send": 2 * padded * (D - 1) / D,
                                           "all_gather_small": small}
    # Gathered: the same, plus an all-gather of the momentum of every bucket holding matrices.
    g = results["gather-muon"]
    gathered = g["payload_bytes_per_step"]["all_gather"]
    # gloo's default: one bucket for this model; p.grad's norms are counted as small
    assert g["calls_per_step"]["all_gather"] == 1
    assert g["calls_per_step"]["all_gather_small"] == 1
    assert gathered == g["distopt_comm"]["payload_bytes_per_step"]["reduce_scatter"]
    norms = wire_bytes("all_gather", small, D)
    assert g["wire_bytes_per_step"] - norms == pytest.approx(
        1.5 * (r["wire_bytes_per_step"] - norms), rel=1e-3)


def test_bytes_per_param(bench):
    _, results = bench
    with torch.device("meta"):
        state = muon_state_bytes(build_model("gpt-tiny", 8).module)
    assert 4 < state < 8  # Muon's 4 B per matrix element, AdamW's 8 for the rest
    assert results["ddp-muon"]["bytes_per_param"] == pytest.approx(8 + state, rel=1e-12)
    for name in ("distopt-muon", "gather-muon"):
        r = results[name]
        assert r["theory_bytes_per_param"] == pytest.approx(8 + state / D, rel=1e-12)
        # The busiest rank: the table plus padding and its share of the state beyond 1/d.
        assert r["theory_bytes_per_param"] <= r["bytes_per_param"] < 8 + state
