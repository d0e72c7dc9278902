"""A Hugging Face Trainer script with distopt underneath: one name changes, nothing else.

    torchrun --nproc_per_node 2 examples/hf_trainer.py
    torchrun --nproc_per_node 4 examples/hf_trainer.py --resume   # the last checkpoint, at d = 4
    python examples/hf_trainer.py --plain                         # transformers.Trainer, to compare

A small Llama, built from its config (random init, nothing downloaded), learns byte-level text
from the Python standard library's sources. ``DistoptTrainer`` takes the Trainer's own
``TrainingArguments``: gradient accumulation, clipping, warm-up + cosine, bf16, evaluation,
checkpoints every ``--save-steps`` steps. At the end each rank prints the training state it
holds per parameter (distopt: 8 + 8/d bytes in fp32, against 16 for the Trainer's DDP). Needs
distopt's ``hf`` extra (``pip install -e '.[hf]'`` in a clone).
"""

from __future__ import annotations

import argparse
import os
import sysconfig
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

import distopt
from distopt.integrations.transformers import DistoptTrainer


class ByteWindows(torch.utils.data.Dataset):
    """Fixed windows of the bytes of some standard-library files, as next-byte prediction."""

    def __init__(self, names: list[str], seq_len: int = 128) -> None:
        root = Path(sysconfig.get_paths()["stdlib"])
        data = b"\0".join((root / name).read_bytes() for name in names)
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
        self.windows = tokens[: len(tokens) // seq_len * seq_len].view(-1, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--save-steps", type=int, default=50)
    parser.add_argument("--output-dir", default="hf-trainer-run")
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--resume", action="store_true", help="resume the last checkpoint")
    parser.add_argument("--bf16", action="store_true", help="autocast to bf16")
    parser.add_argument("--plain", action="store_true", help="transformers.Trainer instead")
    cli = parser.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    world = int(os.environ.get("WORLD_SIZE", "1"))
    accumulation = 2
    args = TrainingArguments(
        output_dir=cli.output_dir,
        use_cpu=not torch.cuda.is_available(),
        ddp_backend=None if world == 1 else ("nccl" if torch.cuda.is_available() else "gloo"),
        # The global batch stays the same at any number of ranks, so a resumed run sees the
        # batches the saved run would have seen.
        per_device_train_batch_size=cli.global_batch // accumulation // world,
        gradient_accumulation_steps=accumulation,
        max_steps=cli.steps,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=cli.steps // 10,
        lr_scheduler_type="cosine",
        max_grad_norm=1.0,
        bf16=cli.bf16,
        logging_steps=10,
        eval_strategy="steps",
        eval_steps=cli.save_steps,
        save_steps=cli.save_steps,
        save_total_limit=2,
        report_to="none",
        seed=0,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
    ))
    trainer_cls = Trainer if cli.plain else DistoptTrainer  # the one change to a Trainer script
    trainer = trainer_cls(
        model=model, args=args,
        train_dataset=ByteWindows(["textwrap.py", "string.py", "shlex.py", "fnmatch.py"]),
        eval_dataset=ByteWindows(["glob.py"]),
    )
    trainer.train(resume_from_checkpoint=True if cli.resume else None)

    if not cli.plain:
        report = distopt.measure_state_bytes(trainer.optimizer.distributed)
        table = distopt.theoretical_bytes_per_param(model.dtype, torch.float32, world)
        print(f"rank {args.process_index}: {report.bytes_per_param:.2f} bytes/param of "
              f"training state (table {table:.2f}; the Trainer's DDP holds 16)")
    # End the process group the Trainer started: left to the interpreter's exit, gloo's
    # threads can abort a rank whose training finished, and the launcher reports a failure.
    trainer.accelerator.end_training()


if __name__ == "__main__":
    main()
