"""Stacked training on CUDA: the captured step replays what the eager step computes, for
every mixer that can run here (bf16 autocast both ways)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from hla_bench import registry
from hla_bench.recall.pool import build_model
from hla_bench.recall.train import RunSpec, _GroupTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MIXERS = ["sdpa", "based", "linear-attn", "hla2", "ahla2", "hla3", "mamba2-ssd",
          "fla-gla", "fla-delta-rule"]


def group(mixer, d_model=64, **changes):
    fields = dict(task="mqar", params=dict(vocab_size=512, seq_len=64, num_kv_pairs=4),
                  mixer=mixer, d_model=d_model, epochs=2, num_train=640, num_val=64,
                  num_test=64, batch_size=128, stop_accuracy=1.1, device="cuda")
    return [RunSpec(lr=lr, seed=seed, run_id=i, **{**fields, **changes})
            for i, (lr, seed) in enumerate([(1e-4, 0), (3e-4, 1), (1e-3, 0)])]


def assert_replay_equals_the_eager_step(mixer: str, compile: bool, steps: int = 8,
                                        **changes) -> None:
    reason = registry.get(mixer).unavailable_reason()
    if reason:
        pytest.skip(reason)
    options = {"dropout": 0.0} if mixer == "sdpa" else {}
    runs = group(mixer, mixer_options=options, **changes)
    eager = _GroupTrainer(runs, build_model, graphs=False, progress=None)
    graphed = _GroupTrainer(runs, build_model, graphs=True, progress=None, compile=compile)
    eager.train_to(steps)
    graphed.train_to(steps)
    assert graphed.graphed and graphed.graph_failure is None, graphed.graph_failure
    # bf16 rounding differs between kernels picked in and out of capture, and AdamW turns a
    # tiny gradient into a step of about lr: compare losses and the parameters' norm.
    torch.testing.assert_close(graphed.loss_sum, eager.loss_sum, rtol=2e-2, atol=1e-3)
    moved = (graphed.model.flat - eager.model.flat).norm(dim=1)
    assert (moved <= 1e-2 * eager.model.flat.norm(dim=1)).all(), moved


@pytest.mark.parametrize("mixer", MIXERS)
def test_graph_replay_equals_the_eager_step(mixer):
    assert_replay_equals_the_eager_step(mixer, compile=False)


@pytest.mark.parametrize("mixer", ["linear-attn", "hla2"])
def test_graph_replay_follows_a_new_batch_order_every_epoch(mixer):
    """MAD's sweeps shuffle: the captured step reads each epoch's order (2 steps an epoch,
    five epochs, four new orders after the capture)."""
    assert_replay_equals_the_eager_step(mixer, compile=False, steps=10, shuffle=True,
                                        num_train=256, epochs=5)


def test_a_run_leaving_the_stack_is_recaptured():
    runs = group("hla2")
    trainer = _GroupTrainer(runs, build_model, graphs=True, progress=None)
    trainer.train_to(4)
    trainer._keep([0, 2])
    trainer.train_to(9)
    assert trainer.graphed and trainer.graph_failure is None, trainer.graph_failure
    assert torch.isfinite(trainer.loss_sum).all()


@pytest.mark.parametrize("compile", [False, True])
def test_attention_dropout_is_captured(compile):
    runs = group("sdpa", mixer_options={"dropout": 0.1, "bias": True}, embed_dropout=0.1)
    trainer = _GroupTrainer(runs, build_model, graphs=True, progress=None, compile=compile)
    trainer.train_to(6)
    assert trainer.graphed and trainer.graph_failure is None, trainer.graph_failure
    assert torch.isfinite(trainer.model.flat).all()


@pytest.mark.parametrize("mixer", ["sdpa", "linear-attn", "hla2", "hla3", "mamba2-ssd"])
def test_compiled_graph_replay_equals_the_eager_step(mixer):
    """torch.compile traces the op where it runs PyTorch code (linear attention, SDPA, hla3's
    chunk form) and breaks around Triton kernels (hla2, mamba_ssm's SSD): the compiled,
    captured step still computes the eager one."""
    assert_replay_equals_the_eager_step(mixer, compile=True)


def test_mamba2_stacked_steps_agree_through_the_triton_scan_and_the_chunk_form():
    """The Mamba-2 block as the Zoology grid runs it (head dim 64, so d_model 256 gives 8
    heads a copy and 24 heads in one scan of 3 stacked copies): the eager training steps
    through mamba_ssm's scan compute what the chunked PyTorch SSD computes."""
    reason = registry.get("mamba2-ssd").unavailable_reason({"impl": "triton"})
    if reason:
        pytest.skip(reason)
    losses = {}
    for impl in ("triton", "chunk"):
        runs = group("mamba2-ssd", d_model=256,
                     mixer_options={"impl": impl, "layer_head_dim": 64})
        trainer = _GroupTrainer(runs, build_model, graphs=False, progress=None)
        trainer.train_to(6)
        losses[impl] = trainer.loss_sum
    torch.testing.assert_close(losses["triton"], losses["chunk"], rtol=2e-2, atol=1e-3)


def test_a_group_records_the_most_gpu_memory_it_held():
    """train_group: every run of a group names the most memory the group's process held
    from PyTorch's allocator, at least its stacked parameters and their AdamW moments. It
    runs in a fresh interpreter, as in a sweep's worker: there the group is the first thing
    that touches CUDA."""
    script = textwrap.dedent("""
        import json
        from hla_bench.recall.pool import build_model
        from hla_bench.recall.train import train_group
        runs = json.loads(input())
        results = train_group(runs, build_model)
        parameters = build_model(runs[0]).parameters()
        floor = 3 * len(runs) * sum(p.numel() * 4 for p in parameters) / 2**20
        print(json.dumps([[r["gpu_memory_mib"] for r in results], floor]))
    """)
    runs = [run.as_dict() for run in group("linear-attn", epochs=1)]
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(runs),
                          capture_output=True, text=True, cwd=Path(__file__).parents[1])
    assert done.returncode == 0, done.stderr
    memory, floor = json.loads(done.stdout.splitlines()[-1])
    assert len(set(memory)) == 1
    assert memory[0] >= floor, (memory, floor)
