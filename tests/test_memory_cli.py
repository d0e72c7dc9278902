"""`distopt memory` prints the memory table of docs/design.md for the sizes asked."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

import distopt
from distopt.cli.memory_command import main
from distopt.dtypes import DTYPES
from distopt.memory import BytesPerParam, bytes_per_param_breakdown


@pytest.mark.parametrize(
    "dtype,grad,dp,replicated,sharded",
    [("bf16", "bf16", 8, 20.0, 4 + 16 / 8), ("bf16", "fp32", 4, 18.0, 6 + 12 / 4),
     ("fp32", "fp32", 2, 16.0, 8 + 8 / 2), ("fp16", "fp16", 3, 20.0, 4 + 16 / 3)],
)
def test_totals_follow_the_table(capsys, dtype, grad, dp, replicated, sharded):
    assert main(["--params", "7e9", "--dp", str(dp), "--dtype", dtype, "--grad-dtype", grad]) == 0
    out = capsys.readouterr().out
    total = re.search(r"^total\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
    assert float(total.group(1)) == pytest.approx(replicated, abs=1e-3)
    assert float(total.group(2)) == pytest.approx(sharded, abs=1e-3)
    assert float(total.group(3)) == pytest.approx(sharded * 7e9 / 2**30, abs=0.01)
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    assert sharded == pytest.approx(
        distopt.theoretical_bytes_per_param(dtypes[dtype], dtypes[grad], dp))


def test_bad_arguments_give_one_line(capsys):
    with pytest.raises(SystemExit):
        main(["--params", "lots"])
    assert "not a number" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--params", "7e9", "--dtype", "fp8"])
    with pytest.raises(ValueError, match="dp_size"):
        distopt.theoretical_bytes_per_param(torch.float32, None, 0)


def test_breakdown_is_the_theory_by_component():
    assert bytes_per_param_breakdown(torch.bfloat16, torch.float32) == BytesPerParam(
        params=2, grads=4, main_params=4, main_grads=0, optimizer_state=8)
    for param, grad, dp, state in itertools.product(DTYPES.values(), DTYPES.values(),
                                                    (1, 2, 3, 8), (4, 8)):
        breakdown = bytes_per_param_breakdown(param, grad, optimizer_state_bytes=state)
        for distributed in (True, False):
            total = distopt.theoretical_bytes_per_param(
                param, grad, dp, distributed=distributed, optimizer_state_bytes=state)
            assert breakdown.total(dp, distributed=distributed) == total
            per_rank = breakdown.per_rank(dp, distributed=distributed)
            assert sum(per_rank.values()) == pytest.approx(total)


@pytest.mark.parametrize("grad,dp,sharded", [("fp32", 4, 6 + 10 / 4), ("bf16", 8, 4 + 10 / 8)])
def test_param_remainders_rows(capsys, grad, dp, sharded):
    argv = ["--params", "7e9", "--dp", str(dp), "--dtype", "bf16", "--grad-dtype", grad]
    assert main([*argv, "--store-param-remainders"]) == 0
    out = capsys.readouterr().out
    total = re.search(r"^total\s+([\d.]+)\s+([\d.]+)", out, re.M)
    assert float(total.group(2)) == pytest.approx(sharded, abs=1e-3)
    remainders = re.search(r"^remainders\s+([\d.]+)\s+([\d.]+)", out, re.M)
    assert float(remainders.group(1)) == 4.0  # replicated keeps fp32 masters
    assert float(remainders.group(2)) == pytest.approx(2 / dp, abs=1e-3)
    main_grads = re.search(r"^fp32 main grads\s+([\d.]+)\s+([\d.]+)", out, re.M)
    # bf16 grads: replicated keeps fp32 copies; with remainders they are per-bucket transients.
    assert float(main_grads.group(1)) == (4.0 if grad == "bf16" else 0.0)
    assert float(main_grads.group(2)) == 0.0
    assert "one bucket's shard at a time" in out
    assert sharded == pytest.approx(distopt.theoretical_bytes_per_param(
        torch.bfloat16, DTYPES[grad], dp, store_param_remainders=True))
    assert main(["--params", "7e9", "--dtype", "fp32", "--store-param-remainders"]) == 2
    assert "needs bf16 params" in capsys.readouterr().err


def _row(out: str, name: str) -> tuple[float, float]:
    """The two B/param columns (flat, sharded) of a row of the cluster plan."""
    match = re.search(rf"^  {re.escape(name)}\s+([\d.]+)\s+\S+ \S+\s+([\d.]+)\s+\S+ \S+$",
                      out, re.M)
    assert match, (name, out)
    return float(match.group(1)), float(match.group(2))


def test_cluster_plan_prints_memory_and_traffic_beside_flat(capsys):
    # 2 nodes x 2 GPUs, shard 2, fp32 (test_cluster_plan.py works these out by hand).
    argv = ["--params", "1e9", "--nodes", "2", "--gpus-per-node", "2", "--shard-size", "2",
            "--dtype", "fp32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "2 nodes x 2 GPUs = 4 ranks; shard size 2: 2 replicas, each shard group inside" in out
    assert _row(out, "optimizer state") == (2.0, 4.0)
    assert _row(out, "total") == (10.0, 12.0)
    assert _row(out, "reduce-scatter (grads)") == (3.0, 2.0)
    assert _row(out, "replicate all-reduce (grads)") == (0.0, 2.0)
    assert _row(out, "all-gather (params)") == (3.0, 2.0)
    assert _row(out, "inside a node, mean") == (3.0, 4.0)
    assert _row(out, "across nodes, mean") == (3.0, 2.0)
    assert _row(out, "across nodes, busiest rank") == (6.0, 2.0)
    # Per rank in bytes: B/param times 1e9 params.
    assert re.search(r"^  across nodes, busiest rank .*5\.59 GiB .*1\.86 GiB$", out, re.M)
    assert "11.18 GiB held instead of 9.31 GiB" in out
    assert "sends 1.86 GiB across nodes per step instead of 5.59 GiB" in out


def test_cluster_plan_defaults_to_a_node_per_shard_group(capsys):
    assert main(["--model", "medium", "--nodes", "2", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert "(19,177,472 params)" in out and "16 ranks; shard size 8: 2 replicas" in out
    # bf16 params, fp32 grads: the replicate chunk is 1/8 of the grads, all-reduced over 2.
    assert _row(out, "replicate all-reduce (grads)") == (0.0, 0.5)
    assert _row(out, "across nodes, busiest rank") == (5.625, 0.5)
    argv = ["--params", "7e9", "--nodes", "4", "--grad-dtype", "bf16"]
    assert main([*argv, "--reduce-scatter-fp32-accumulation"]) == 0
    out = capsys.readouterr().out
    # Gathered for the fp32 sum: (4 - 1) * 2 B / 8 instead of 2 * 3/4 * 2 B / 8.
    assert _row(out, "replicate gather (grads)") == (0.0, 0.75)


@pytest.mark.parametrize("argv,message", [
    (["--shard-size", "8"], "--shard-size: options of the cluster plan; add --nodes"),
    (["--nodes", "2", "--dp", "4"], "--dp 4 is not the cluster's 16 ranks"),
    (["--nodes", "2", "--shard-size", "3"], "--shard-size 3 does not divide the 16 ranks"),
    (["--nodes", "2", "--reduce-scatter-fp32-accumulation"], "add --grad-dtype bf16"),
])
def test_cluster_plan_bad_options_give_one_line(capsys, argv, message):
    assert main(["--params", "7e9", *argv]) == 2
    assert message in capsys.readouterr().err


def _rows(out: str) -> list[list[float]]:
    """The per-rank rows of the bytes table: table, padding, owned, B/param, bytes."""
    return [[float(x.replace(",", "")) for x in m.groups()] for m in re.finditer(
        r"^\s+\d+\s+([\d.]+)\s+([\d.]+)\s+([-+][\d.]+)\s+([\d.]+)\s+([\d,]+)$", out, re.M)]


def test_muon_balance_of_gpt_small(capsys):
    """GPT small at d = 4 under the Muon recipe: one layer's Newton-Schulz work per rank, and
    the padding the bucket size decides (tests/test_balance.py measures the same layouts)."""
    assert main(["--model", "small", "--dp", "4", "--optimizer", "muon", "--dtype", "fp32"]) == 0
    out = capsys.readouterr().out
    assert "Muon for 16 hidden matrices (3,145,728 params)" in out
    assert "busiest rank: 2.013e+08, 1.0000x the mean" in out
    rows = _rows(out)
    assert len(rows) == 4
    # 8 B of params and grads, and 4 B of momentum per matrix element beside AdamW's 8 for the
    # 144,896 others, over 4 ranks; NCCL's default buckets leave no padding.
    table = 8 + (4 * 3_145_728 + 8 * 144_896) / 3_290_624 / 4
    for row in rows:
        assert row[:4] == pytest.approx([table, 0, 0, table], abs=1e-4)
        assert row[4] == 8 * 3_290_624 + (4 * 3_145_728 + 8 * 144_896) / 4
    # Gloo's default bucket size (half the model), and the same size given: the buckets are
    # cut where their shards come out equal, so no padding either.
    for argv in (["--backend", "gloo"], ["--bucket-size", "1645312"]):
        assert main(["--model", "small", "--dp", "4", "--optimizer", "muon", "--dtype", "fp32",
                     *argv]) == 0
        out = capsys.readouterr().out
        assert "padding 0 elements = 0.00% of the buffer" in out
        assert [row[1] for row in _rows(out)] == [0] * 4


def test_adafactor_and_bad_whole_tensor_options(capsys):
    assert main(["--model", "tiny", "--dp", "2", "--optimizer", "adafactor"]) == 0
    out = capsys.readouterr().out
    assert "Adafactor for every param" in out and len(_rows(out)) == 2
    assert main(["--params", "7e9", "--optimizer", "muon"]) == 2
    assert "--optimizer needs --model" in capsys.readouterr().err
    assert main(["--model", "tiny", "--optimizer", "muon", "--nodes", "2"]) == 2
    assert "drop --nodes" in capsys.readouterr().err
    assert main(["--model", "small", "--backend", "gloo"]) == 2
    assert "--backend picks the buckets of a --model under an --optimizer" in (
        capsys.readouterr().err)
    with pytest.raises(SystemExit):
        main(["--model", "small", "--optimizer", "lbfgs"])


@pytest.mark.parametrize(("dtype", "grad", "remainders", "whole", "sharded"), [
    ("bf16", "bf16", True, 2, 2 + 2 + 8),   # the row: 2 + 12/d
    ("fp32", "fp32", False, 4, 4 + 8),      # 4 + 12/d
    ("bf16", "bf16", False, 2, 2 + 4 + 4 + 8),  # fp32 main params and main grads stay
    ("bf16", "fp32", False, 2, 4 + 4 + 8),
])
def test_shard_grads_rows(capsys, dtype, grad, remainders, whole, sharded):
    for dp in (1, 2, 4, 8):
        total = distopt.theoretical_bytes_per_param(
            DTYPES[dtype], DTYPES[grad], dp, store_param_remainders=remainders,
            shard_grads=True)
        assert total == whole + sharded / dp
        breakdown = bytes_per_param_breakdown(DTYPES[dtype], DTYPES[grad],
                                              store_param_remainders=remainders,
                                              shard_grads=True)
        assert breakdown.per_rank(dp)["grads"] == DTYPES[grad].itemsize / dp
        # The replicated column never shards the grads.
        assert breakdown.per_rank(dp, distributed=False)["grads"] == DTYPES[grad].itemsize
    argv = ["--params", "7e9", "--dp", "8", "--dtype", dtype, "--grad-dtype", grad,
            *(["--store-param-remainders"] if remainders else []), "--shard-grads"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    total = re.search(r"^total\s+([\d.]+)\s+([\d.]+)", out, re.M)
    assert float(total.group(2)) == pytest.approx(whole + sharded / 8, abs=1e-3)
    grads = re.search(r"^grads\s+([\d.]+)\s+([\d.]+)", out, re.M)
    assert float(grads.group(1)) == DTYPES[grad].itemsize
    assert float(grads.group(2)) == pytest.approx(DTYPES[grad].itemsize / 8, abs=1e-3)
    assert "no grad buffer is kept whole" in out


def test_shard_grads_in_the_cluster_plan_and_the_ownership_plan(capsys):
    # fp32 grads sharded over the 4 ranks (flat) or the shard group of 2.
    assert main(["--params", "1e9", "--nodes", "2", "--gpus-per-node", "2", "--shard-size", "2",
                 "--dtype", "fp32", "--shard-grads"]) == 0
    out = capsys.readouterr().out
    assert _row(out, "grads") == (1.0, 2.0)
    assert _row(out, "total") == (4 + 12 / 4, 4 + 12 / 2)
    figures = {}
    for shard_grads in (False, True):
        argv = ["--model", "small", "--dp", "4", "--optimizer", "muon", "--dtype", "fp32"]
        assert main(argv + (["--shard-grads"] if shard_grads else [])) == 0
        out = capsys.readouterr().out
        figures[shard_grads] = (
            float(re.search(r"^\s+0\s+([\d.]+)\s+[\d.]+\s+\+", out, re.M).group(1)),
            float(re.search(r"busiest rank ([\d.]+) B/param", out).group(1)),
        )
    # The grads: 4 B/param whole without, 4/4 with (the padding's share aside).
    assert figures[True][0] == pytest.approx(figures[False][0] - 3.0, abs=1e-4)
    assert figures[True][1] < figures[False][1] - 2.9


@pytest.mark.parametrize(
    "argv,per_param",
    # torch's layout: the fp32 main params (not the params' own dtype) and the state
    [(["--dtype", "fp32", "--dp", "2"], (4 + 8) / 2),
     (["--dtype", "bf16", "--dp", "4", "--state-dtype", "bf16"], (4 + 4) / 4),
     # fp8 state is written as its fp32 values: 4 bytes per moment
     (["--dtype", "bf16", "--dp", "8", "--state-dtype", "fp8-e4m3"], (4 + 8) / 8),
     (["--dtype", "bf16", "--dp", "3", "--optimizer-state-bytes", "4"], (4 + 4) / 3),
     (["--dtype", "bf16", "--nodes", "2", "--gpus-per-node", "4"], (4 + 8) / 8)],
)
def test_async_staging_is_each_ranks_part_of_a_checkpoint(capsys, argv, per_param):
    assert main(["--params", "1e9", *argv]) == 0
    out = capsys.readouterr().out
    line = re.search(r"^async checkpoint staging: ([\d.]+) B/param, ([\d.]+) GiB", out, re.M)
    assert line, out
    assert float(line.group(1)) == pytest.approx(per_param, abs=1e-3)
    assert float(line.group(2)) == pytest.approx(per_param * 1e9 / 2**30, abs=0.01)


def _stage_row(out: str, name: str) -> list[str]:
    """The cells of a row of the per-stage table, one per stage."""
    row = re.search(rf"^{name}\s+(.+)$", out, re.M).group(1)
    return re.findall(r"[\d,.]+(?: MiB)?", row)


@pytest.mark.parametrize("pp,dp,extra", [(2, 2, []), (4, 1, ["--shard-grads"]),
                                         (1, 3, ["--dtype", "fp32"])])
def test_pp_prints_each_stage_at_its_dp_size(capsys, pp, dp, extra):
    from distopt.cli import main as distopt_main
    from distopt.train.model import GPT, gpt_config
    from distopt.train.stages import stage_param_counts

    assert distopt_main(["memory", "--model", "small", "--pp", str(pp), "--dp", str(dp),
                         *extra]) == 0
    out = capsys.readouterr().out
    with torch.device("meta"):
        gpt = GPT(gpt_config("small", seq_len=256))
    counts = stage_param_counts(gpt, pp)  # the stages distopt train --pp builds
    # Each stage holds its blocks; the tied embedding/head is on the first and the last.
    tie = gpt.wte.weight.numel() if pp > 1 else 0
    assert sum(counts) == gpt.num_params() + tie
    assert [int(c.replace(",", "")) for c in _stage_row(out, "params")] == counts
    dtype = torch.float32 if "fp32" in extra else torch.bfloat16
    table = bytes_per_param_breakdown(dtype, torch.float32, shard_grads="--shard-grads" in extra)
    per_rank = table.per_rank(dp)
    grads = "grads" if "--shard-grads" in extra else "grad buffer"
    for label, name in [("model params", "params"), (grads, "grads"),
                        ("optimizer state", "optimizer_state")]:
        cells = [float(c.removesuffix(" MiB").replace(",", "")) for c in _stage_row(out, label)]
        assert cells == [round(per_rank[name] * n / 2**20, 2) for n in counts], label
    totals = [table.total(dp) * n for n in counts]
    busiest = max(range(pp), key=totals.__getitem__)
    assert f"busiest stage: {busiest}, {totals[busiest] / 2**20:,.2f} MiB per rank" in out
    assert f"{pp} pipeline stages x data-parallel size {dp} ({pp * dp} ranks)" in out


@pytest.mark.parametrize("argv,message", [
    (["--model", "small", "--pp", "3"], "--pp 3 does not divide the 4 blocks of --model small; "
                                        "pick a divisor of 4"),
    (["--params", "7e9", "--pp", "2"], "--pp N splits a demo GPT preset's blocks into stages: "
                                       "add --model"),
    (["--model", "small", "--moe", "4", "--pp", "2"], "--pp does not compose with --moe"),
    (["--model", "small", "--pp", "2", "--nodes", "2"], "--pp does not compose with --nodes"),
    (["--model", "small", "--pp", "0"], "--pp must be >= 1"),
])
def test_pp_bad_options_give_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_shard_params_peak_of_a_resized_preset(capsys):
    """--layers and --width resize the preset; the peak is the state plus the transient bound
    of the model's real layout, which distopt.memory.transient_bound_of_model computes."""
    from distopt.memory import transient_bound_of_model
    from distopt.train.model import GPT, gpt_config

    argv = ["--model", "small", "--layers", "3", "--width", "512", "--heads", "8", "--dp", "2",
            "--dtype", "fp32", "--grad-dtype", "fp32", "--shard-params", "--backend", "gloo"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    with torch.device("meta"):
        model = GPT(gpt_config("small", seq_len=256, n_layer=3, n_embd=512, n_head=8))
    bound = transient_bound_of_model(model, 2, gloo=True)
    # Three blocks of 3.1M elements are the units, two gathered at once; the embeddings and the
    # final norm are loose.
    assert 2 * 12 * 512 * 512 * 4 < bound.gathered_params < 3 * 12 * 512 * 512 * 4
    match = re.search(r"bound ([\d.]+)\n\+ a process with torch imported ([\d.]+) .* = "
                      r"([\d.]+) GiB", out)
    assert match, out
    assert float(match.group(1)) == pytest.approx(bound.total / 2**30, abs=0.006)
    state = 16 / 2 * model.num_params() / 2**30  # fp32 params, grads, AdamW: 16 B over d = 2
    assert float(match.group(3)) == pytest.approx(
        state + float(match.group(1)) + float(match.group(2)), abs=0.02)
    assert main(["--params", "7e9", "--layers", "3"]) == 2
    assert "--layers, --width and --heads change a --model preset" in capsys.readouterr().err


def test_pipeline_stages_state_the_step_held_whole(capsys):
    """With sharded grads or params a stage holds its step whole (one reduction per step):
    its grads, and with sharded params its params, whole during the step."""
    assert main(["--model", "small", "--pp", "2", "--dp", "2", "--dtype", "fp32",
                 "--grad-dtype", "fp32", "--shard-params"]) == 0
    out = capsys.readouterr().out
    total = [float(v) for v in re.search(r"^total\s+([\d.]+) MiB\s+([\d.]+) MiB", out,
                                         re.M).groups()]
    during = [float(v) for v in re.search(r"^during a step\s+([\d.]+) MiB\s+([\d.]+) MiB", out,
                                          re.M).groups()]
    # fp32 params and grads, 8 B/param, half of them on each of d = 2 ranks between steps.
    counts = [int(v.replace(",", "")) for v in re.search(
        r"^params\s+([\d,]+)\s+([\d,]+)", out, re.M).groups()]
    for t, d, n in zip(total, during, counts, strict=True):
        assert d == pytest.approx(t + 8 * n / 2 / 2**20, abs=0.011)
    assert main(["--model", "small", "--pp", "2", "--dp", "2"]) == 0
    assert "during a step" not in capsys.readouterr().out  # full buffers hold it all along


@pytest.mark.parametrize("argv,tier,ram", [
    # fp32 params are their own masters: the tier holds AdamW's two fp32 moments.
    (["--dtype", "fp32", "--grad-dtype", "fp32", "--shard-params"], 8 / 4, 8 / 4),
    # The lean tier: remainders (2) and two bf16 moments (4) on the tier; bf16 params and
    # grads (2 + 2) in RAM.
    (["--dtype", "bf16", "--grad-dtype", "bf16", "--store-param-remainders",
      "--state-dtype", "bf16", "--shard-params"], 6 / 4, 4 / 4),
    # ZeRO-1 with bf16 params: fp32 masters and moments (4 + 8) on the tier, sharded.
    (["--dtype", "bf16", "--grad-dtype", "fp32"], 12 / 4, 2 + 4),
])
def test_offload_moves_masters_and_state_to_the_tier(capsys, argv, tier, ram):
    assert main(["--params", "4e9", "--dp", "4", "--offload", *argv]) == 0
    out = capsys.readouterr().out
    found = re.search(r"([\d.]+) GiB per rank on the tier \(([\d.]+) B/param.*?"
                      r"([\d.]+) GiB per rank in RAM\s+\(([\d.]+) B/param\)", out, re.S)
    assert found is not None, out
    assert float(found.group(2)) == pytest.approx(tier, abs=1e-3)
    assert float(found.group(1)) == pytest.approx(tier * 4e9 / 2**30, abs=0.01)
    assert float(found.group(4)) == pytest.approx(ram, abs=1e-3)


def test_offload_bound_counts_one_shard_of_the_tier():
    """The step's transient with the tier: the stepped shard's remainders (2 B) and bf16
    moments (4 B) beside the lean step's fp32 temporaries (AdamW's 4, masters and grads 8,
    moments widened 8): 26 bytes an element of the widest shard against 20."""
    from distopt.memory import transient_bound_of_model
    from distopt.train.model import GPT, gpt_config

    with torch.device("meta"):
        model = GPT(gpt_config("small", seq_len=64)).to(torch.bfloat16)
    lean = dict(grad_dtype=torch.bfloat16, store_param_remainders=True,
                state_dtype=torch.bfloat16)
    plain = transient_bound_of_model(model, 4, **lean)
    offloaded = transient_bound_of_model(model, 4, **lean, offload=True)
    widest = plain.step // 20
    assert plain.step == 20 * widest and offloaded.step == 26 * widest
    assert offloaded.gathered_params == plain.gathered_params
