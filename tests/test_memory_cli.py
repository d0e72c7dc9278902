"""`distopt memory` prints DESIGN.md's table for the sizes asked."""

from __future__ import annotations

import re

import pytest
import torch

import distopt
from distopt.memory_cli import main


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
