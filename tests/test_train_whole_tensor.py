"""`distopt train --optimizer muon | adafactor`: the whole-tensor optimizers in the training job.

Each run trains the tiny GPT for 8 steps on 2 ranks of the test pool without checkpoints
(--no-save), and the summary must show the loss falling and each rank's bytes equal to the
layout's arithmetic: the table with the recipe's optimizer state, plus the padding, plus the
state of what the rank owns beyond an even share ([Note: memory of whole-tensor ownership]
in distopt/plan/ownership.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from distopt.train.model import gpt_config

from dist_harness import case_result, run_cases
from helpers import SMALL_TRAIN, train_in_pool, train_in_pool_killed

pytestmark = pytest.mark.slow

# SMALL_TRAIN saves checkpoints every 4 steps; the runs here write none, but the last test's.
_AT = SMALL_TRAIN.index("--save-every")
NO_SAVE = [*SMALL_TRAIN[:_AT], *SMALL_TRAIN[_AT + 2 :], "--no-save"]


def _shapes() -> tuple[list[tuple[int, int]], int]:
    """The tiny GPT of SMALL_TRAIN (seq_len 32): its hidden matrices, and the elements of the
    rest."""
    config = gpt_config("tiny", seq_len=32)
    e, layers = config.n_embd, config.n_layer
    matrices = layers * [(3 * e, e), (e, e), (4 * e, e), (e, 4 * e)]
    rest = config.vocab_size * e + config.seq_len * e + layers * (2 * 2 * e + 3 * e + e + 4 * e
                                                                  + e) + 2 * e
    return matrices, rest


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[Path, str]]:
    """Both runs as cases of the pool of two ranks (no launcher: what they test is the
    optimizers' work); rank 0's output."""
    runs = {"muon": ("muon",), "adafactor": ("adafactor",),
            "muon-shard-params": ("muon", "--shard-params")}
    paths = {name: tmp_path_factory.mktemp(name) for name in runs}
    printed = run_cases(2, [(name, train_in_pool,
                             (*NO_SAVE, "--optimizer", *runs[name], "--out", str(path)))
                            for name, path in paths.items()])
    return {name: (path, case_result(printed, name)[0]) for name, path in paths.items()}


def _summary(path: Path) -> dict:
    return json.loads((path / "summary.json").read_text())


@pytest.mark.parametrize("optimizer,name", [("muon", "Muon"), ("adafactor", "Adafactor")])
def test_whole_tensor_runs_learn(runs, optimizer, name):
    path, stdout = runs[optimizer]
    summary = _summary(path)
    assert summary["optimizer"] == name
    evals = [json.loads(line)["heldout_loss"] for line in
             (path / "metrics.jsonl").read_text().splitlines() if "heldout_loss" in line]
    assert len(evals) == 3
    # 8 steps from 5.42 nats per byte: AdamW reaches about 4.5; a step that did nothing, or
    # stepped a wrong slice, would stay near the start.
    assert evals[-1] < 0.9 * evals[0], evals
    assert "imbalance max/mean" in stdout
    assert not (path / "checkpoints").exists()


def test_muon_bytes_per_param_follow_the_recipe(runs):
    path, stdout = runs["muon"]
    summary = _summary(path)
    matrices, rest = _shapes()
    n_matrix = sum(a * b for a, b in matrices)
    n = summary["num_params"]
    assert n == n_matrix + rest
    # Muon keeps one fp32 momentum per matrix element, AdamW two moments per other element.
    state = 4 * n_matrix + 8 * rest
    assert sum(r["optimizer_state"] for r in summary["memory_per_rank"]) == state
    theory = summary["theory_bytes_per_param"]
    assert theory["distopt"] == pytest.approx(8 + state / n / 2, rel=1e-12)
    assert theory["replicated"] == pytest.approx(8 + state / n, rel=1e-12)  # plain DDP + both
    whole = summary["whole_tensor"]
    assert whole["table_bytes_per_param"] == pytest.approx(theory["distopt"], rel=1e-12)
    # What each rank measured is the layout's arithmetic, to the byte, component by component.
    assert whole["expected_per_rank"] == summary["memory_per_rank"]
    for report in summary["memory_per_rank"]:
        assert report["params"] == 4 * (n + whole["padding_elements"])
    (balance,) = whole["balance"]
    # Two blocks of four matrices on two ranks: one block's worth of Newton-Schulz each.
    block = 192 * 64**2 + 64**3 + 2 * 256 * 64**2
    assert balance["cost"] == [block, block] and balance["imbalance"] == 1.0


def test_muon_with_sharded_params_holds_its_shard_of_the_params(runs):
    """The same layout with the params sharded too: each rank holds half of the params the
    full-buffer run holds, what it measured is the layout's arithmetic to the byte, and the
    run ends on the same bits (the same grads, the same whole-matrix steps)."""
    path, _ = runs["muon-shard-params"]
    summary, full = _summary(path), _summary(runs["muon"][0])
    assert summary["whole_tensor"]["expected_per_rank"] == summary["memory_per_rank"]
    for report, before in zip(summary["memory_per_rank"], full["memory_per_rank"], strict=True):
        assert 2 * report["params"] == before["params"]
        assert report["optimizer_state"] == before["optimizer_state"]
    assert summary["heldout_loss_end"] == full["heldout_loss_end"]


def test_adafactor_keeps_rows_and_columns(runs):
    path, _ = runs["adafactor"]
    summary = _summary(path)
    assert summary["config"]["lr"] == 0.1  # Adafactor's own default: its lr is relative
    config = gpt_config("tiny", seq_len=32)
    matrices, _ = _shapes()
    matrices += [(config.vocab_size, config.n_embd), (config.seq_len, config.n_embd)]
    vectors = summary["num_params"] - sum(a * b for a, b in matrices)
    state = 4 * (sum(a + b for a, b in matrices) + vectors)
    assert sum(r["optimizer_state"] for r in summary["memory_per_rank"]) == state
    whole = summary["whole_tensor"]
    assert whole["expected_per_rank"] == summary["memory_per_rank"]
    # Every param is owned whole, balanced by elements: the ranks' elements differ by at most
    # the largest param's (the embedding, 256 x 64).
    (balance,) = whole["balance"]
    assert abs(balance["cost"][0] - balance["cost"][1]) <= 256 * 64
    assert sum(balance["cost"]) == summary["num_params"]


def test_muon_run_resumes_after_a_crash(runs, tmp_path):
    """A Muon run whose rank 1 is killed at step 6 resumes from its step-4 checkpoint and ends
    exactly where the uninterrupted run (without checkpoints) ends. Both halves are cases of
    the pool: what they test is the whole-tensor optimizer's checkpoint (test_train.py checks
    the launcher's restart of a killed rank, and ``--resume`` after a launched run crashed)."""
    args = (*SMALL_TRAIN, "--optimizer", "muon", "--out", str(tmp_path))
    crashed = run_cases(2, [("crashed", train_in_pool_killed, (6, 1, *args))])
    assert crashed[1]["crashed"][0] == "error"
    assert "exit code -9" in crashed[1]["crashed"][1], crashed  # SIGKILL, at step 6
    case_result(run_cases(2, [("resumed", train_in_pool, (*args, "--resume"))]), "resumed")
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r.get("resumed")] == [4]
    uninterrupted = _summary(runs["muon"][0])["heldout_loss_end"]
    assert _summary(tmp_path)["heldout_loss_end"] == uninterrupted
