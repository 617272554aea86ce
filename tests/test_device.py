"""Devices and precision: the choice, the arithmetic, and what stays device-independent.

Everything here runs on the CPU; what only a GPU shows is marked `gpu` and is
skipped (with the reason) where torch sees no CUDA device.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shoal.averaging.fingerprint import state_fingerprint
from shoal.averaging.host_state import check_params, copy_into, delta_into, host_clone
from shoal.peer.trainer import DEFAULT_HYPERPARAMETERS, check_hyperparameters
from shoal.peer.training.device import (
    MAX_CPU_FP16_SLOWDOWN,
    DeviceError,
    DeviceInfo,
    DeviceInventory,
    GpuInfo,
    check_precision,
    choose_device,
    cpu_fp16_slowdown,
    describe,
    mfu,
    peak_flops,
)
from shoal.peer.training.inner import BatchPrefetcher, InnerOptimizer
from shoal.peer.training.tasks.bytegpt import make_task

NONE = DeviceInventory()
A100 = GpuInfo("NVIDIA A100-SXM4-80GB", 80 * 2**30, (8, 0))
T4 = GpuInfo("Tesla T4", 15 * 2**30, (7, 5))
TWO_GPUS = DeviceInventory(cuda=(A100, T4))
MAC = DeviceInventory(mps=True)
TINY = {"d_model": 32, "n_layers": 1, "n_heads": 2, "context": 32, "batch_size": 4}


# ---------------------------------------------------------------- choosing a device


def test_auto_takes_the_first_cuda_gpu_then_an_apple_gpu_then_the_cpu() -> None:
    assert choose_device("auto", TWO_GPUS) == torch.device("cuda", 0)
    assert choose_device("auto", MAC) == torch.device("mps")
    assert choose_device("auto", NONE) == torch.device("cpu")


def test_explicit_devices_are_taken_when_present() -> None:
    assert choose_device("cpu", TWO_GPUS) == torch.device("cpu")
    assert choose_device("cuda", TWO_GPUS) == torch.device("cuda", 0)
    assert choose_device("cuda:1", TWO_GPUS) == torch.device("cuda", 1)
    assert choose_device(" CUDA:1 ", TWO_GPUS) == torch.device("cuda", 1)
    assert choose_device("mps", MAC) == torch.device("mps")


@pytest.mark.parametrize(
    ("request_", "inventory", "says"),
    [
        ("cuda", NONE, "torch sees no CUDA GPU"),
        ("cuda:0", MAC, "torch sees no CUDA GPU"),
        ("cuda:2", TWO_GPUS, "numbered 0 to 1"),
        ("mps", TWO_GPUS, "no Apple GPU"),
        ("tpu", TWO_GPUS, "expected auto, cpu, cuda"),
    ],
)
def test_an_absent_device_is_a_clear_error(
    request_: str, inventory: DeviceInventory, says: str
) -> None:
    with pytest.raises(DeviceError, match=says):
        choose_device(request_, inventory)


def test_precision_is_refused_where_it_cannot_run_well() -> None:
    check_precision("fp32", torch.device("cpu"), NONE)
    check_precision("bf16", torch.device("cpu"), NONE)
    check_precision("bf16", torch.device("cuda", 0), TWO_GPUS)
    check_precision("fp16", torch.device("cuda", 1), TWO_GPUS)
    with pytest.raises(DeviceError, match=r"compute capability 8\.0"):
        check_precision("bf16", torch.device("cuda", 1), TWO_GPUS)  # a T4
    with pytest.raises(DeviceError, match="expected fp32"):
        check_precision("fp8", torch.device("cpu"), NONE)


def test_fp16_on_a_cpu_is_refused_where_that_cpu_runs_it_much_slower_than_fp32() -> None:
    """CPUs differ (fp16 17x slower than fp32 on a 2-core EPYC, 0.89x on an H200
    machine's Xeon), so a CPU peer measures its own before it refuses an fp16
    experiment, and says what it measured."""
    slow_cpu = DeviceInventory(cpu_fp16_slowdown=17.0)
    with pytest.raises(DeviceError, match="this CPU runs 17x slower than fp32"):
        check_precision("fp16", torch.device("cpu"), slow_cpu)
    check_precision("fp16", torch.device("cpu"), DeviceInventory(cpu_fp16_slowdown=0.89))
    a_gpu_beside_it = DeviceInventory(cuda=(A100, T4), cpu_fp16_slowdown=17.0)
    check_precision("fp16", torch.device("cuda", 1), a_gpu_beside_it)
    measured = cpu_fp16_slowdown()  # (not measured yet in NONE: measured when asked)
    assert measured > 0 and math.isfinite(measured)
    assert cpu_fp16_slowdown() == measured  # once per process
    if measured > MAX_CPU_FP16_SLOWDOWN:
        with pytest.raises(DeviceError, match="slower than fp32"):
            check_precision("fp16", torch.device("cpu"), NONE)
    else:
        check_precision("fp16", torch.device("cpu"), NONE)


def test_precision_is_an_experiment_hyperparameter_defaulting_to_fp32() -> None:
    assert check_hyperparameters({})["precision"] == "fp32"
    assert check_hyperparameters({"precision": "bf16"})["precision"] == "bf16"
    with pytest.raises(ValueError, match="precision must be one of"):
        check_hyperparameters({"precision": "fp8"})
    assert "precision" in DEFAULT_HYPERPARAMETERS


# ---------------------------------------------------------------- what is reported


def test_the_cpu_is_described_with_its_memory() -> None:
    info = describe(torch.device("cpu"), NONE).as_json()
    assert info["kind"] == "cpu" and info["name"]
    assert 0 < info["memory_used_bytes"] < info["memory_total_bytes"]
    assert set(info) == {"kind", "name", "memory_used_bytes", "memory_total_bytes"}


def test_mfu_is_known_only_where_the_peak_is() -> None:
    a100 = DeviceInfo("cuda", A100.name, 0, A100.memory_total_bytes)
    assert peak_flops(a100, "bf16") == 312e12
    assert peak_flops(a100, "fp32") == 19.5e12
    assert peak_flops(DeviceInfo("cuda", "Some Future GPU", 0, 1), "bf16") is None
    assert peak_flops(DeviceInfo("cpu", "x86", 0, 1), "fp32") is None
    assert mfu(1e9, 1e5, 312e12) == pytest.approx(1e14 / 312e12)
    assert mfu(1e9, None, 312e12) is None
    assert mfu(None, 1e5, 312e12) is None
    assert mfu(1e9, 1e5, None) is None


def test_bytegpt_counts_its_training_flops_per_token() -> None:
    task = make_task(TINY)
    d, layers, context = 32, 1, 32
    weights = layers * 12 * d * d + 256 * d
    assert task.flops_per_token() == 3 * (2 * weights + layers * 2 * context * d)
    # the matrices dominate: about 6 FLOPs per parameter they hold
    model = task.make_model(0)
    params = sum(p.numel() for p in model.parameters())
    assert 4 * params < task.flops_per_token() < 8 * params


# ---------------------------------------------------------------- the inner step


def _steps(precision: str, steps: int = 30) -> list[float]:
    task = make_task(TINY)
    model = task.make_model(0)
    inner = InnerOptimizer(
        model,
        check_hyperparameters({"inner_lr": 3e-3}),
        device=torch.device("cpu"),
        precision=precision,
    )
    batches = task.batches(0, 1, 0)
    losses = []
    for i in range(steps):
        batch = next(batches)
        losses.append(inner.step(lambda b=batch: task.loss(model, b), i))
    return losses


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_training_lowers_the_loss_at_each_cpu_precision(precision: str) -> None:
    losses = _steps(precision)
    assert all(torch.isfinite(torch.tensor(losses)))
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.05


def test_bf16_autocast_keeps_parameters_and_optimizer_state_in_float32() -> None:
    task = make_task(TINY)
    model = task.make_model(0)
    inner = InnerOptimizer(
        model, check_hyperparameters({}), device=torch.device("cpu"), precision="bf16"
    )
    batch = next(task.batches(0, 1, 0))
    inner.step(lambda: task.loss(model, batch), 0)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    state = inner.optimizer.state_dict()["state"]
    assert {t.dtype for s in state.values() for k, t in s.items() if k != "step"} == {torch.float32}


def test_fp16_scales_the_loss_and_the_scaler_state_is_checkpointed() -> None:
    task = make_task(TINY)
    model = task.make_model(0)
    inner = InnerOptimizer(
        model, check_hyperparameters({}), device=torch.device("cpu"), precision="fp16"
    )
    assert inner.scaler.is_enabled()
    batch = next(task.batches(0, 1, 0))
    inner.step(lambda: task.loss(model, batch), 0)
    saved = inner.state_dict()
    assert saved["grad_scaler"]["scale"] > 1
    other = InnerOptimizer(
        task.make_model(0),
        check_hyperparameters({}),
        device=torch.device("cpu"),
        precision="fp16",
    )
    other.load_state_dict(saved)
    assert other.scaler.get_scale() == inner.scaler.get_scale()


def test_the_prefetcher_yields_the_same_batches_in_order_and_forwards_errors() -> None:
    def source():
        for i in range(5):
            yield {"x": torch.full((2,), i), "n": i}
        raise RuntimeError("the corpus went away")

    prefetched = BatchPrefetcher(source(), torch.device("cpu"), depth=2)
    try:
        got = [next(prefetched) for _ in range(5)]
        assert [b["n"] for b in got] == list(range(5))
        assert all(torch.equal(b["x"], torch.full((2,), i)) for i, b in enumerate(got))
        with pytest.raises(RuntimeError, match="went away"):
            next(prefetched)
    finally:
        prefetched.close()


def test_closing_the_prefetcher_stops_its_thread_while_the_queue_is_full() -> None:
    def endless():
        while True:
            yield torch.zeros(3)

    prefetched = BatchPrefetcher(endless(), torch.device("cpu"), depth=1)
    next(prefetched)
    prefetched.close()
    assert not prefetched._thread.is_alive()


# ---------------------------------------------------------------- device-independent state


def test_host_state_is_float32_and_deltas_are_exactly_base_minus_params() -> None:
    g = torch.Generator().manual_seed(1)
    params = check_params([torch.randn(5, 3, generator=g), torch.randn(7, generator=g)])
    base = [host_clone(p) for p in params]
    for p in params:
        p.add_(torch.randn(p.shape, generator=g))
    out = [torch.empty(p.shape) for p in params]
    delta_into(out, base, params)
    for o, b, p in zip(out, base, params, strict=True):
        assert torch.equal(o, b - p)
    copy_into(params, base)
    assert all(torch.equal(p, b) for p, b in zip(params, base, strict=True))


def test_parameters_must_share_one_device() -> None:
    with pytest.raises(TypeError, match="floating-point"):
        check_params([torch.zeros(2, dtype=torch.long)])
    with pytest.raises(TypeError, match="is on meta"):
        check_params([torch.zeros(2), torch.zeros(2, device="meta")])


def test_fingerprints_do_not_depend_on_where_the_state_was_computed() -> None:
    """The globals a strategy fingerprints are host float32 copies, whatever the model's dtype."""
    values = torch.randn(100, generator=torch.Generator().manual_seed(3))
    from_fp32 = host_clone(values)
    from_contiguous_view = host_clone(values.view(10, 10).t().contiguous().t().reshape(100))
    assert state_fingerprint([from_fp32]) == state_fingerprint([from_contiguous_view])
    assert from_fp32.dtype == torch.float32 and from_fp32.device.type == "cpu"


def test_a_checkpoint_holds_host_tensors_and_loads_into_a_fresh_trainer(tmp_path: Path) -> None:
    """What the trainer writes is on the CPU (loadable on any device) and resumes exactly."""
    from shoal.peer.trainer import _clone

    task = make_task(TINY)
    model = task.make_model(0)
    inner = InnerOptimizer(model, check_hyperparameters({}), device=torch.device("cpu"))
    batch = next(task.batches(0, 1, 0))
    inner.step(lambda: task.loss(model, batch), 0)
    snapshot = _clone({"model": model.state_dict(), "inner": inner.state_dict()})
    path = tmp_path / "state.pt"
    torch.save(snapshot, path)
    loaded = torch.load(path, map_location="cpu", weights_only=True)
    fresh = task.make_model(1)
    fresh.load_state_dict(loaded["model"])
    again = InnerOptimizer(fresh, check_hyperparameters({}), device=torch.device("cpu"))
    again.load_state_dict(loaded["inner"])
    assert all(
        torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True)
    )
    mine, theirs = inner.optimizer.state_dict()["state"], again.optimizer.state_dict()["state"]
    assert all(torch.equal(mine[k]["exp_avg"], theirs[k]["exp_avg"]) for k in mine)


# ---------------------------------------------------------------- the daemon


def test_asking_for_a_gpu_that_is_not_there_is_one_line_and_status_2(tmp_path: Path) -> None:
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(HOME=str(tmp_path), SHOAL_LISTEN="/ip4/127.0.0.1/tcp/0", SHOAL_STATUS_ADDR="off")
    result = subprocess.run(
        [sys.executable, "-m", "shoal.peer", "run", "--device", "cuda"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("shoal: error: ")]
    assert len(errors) == 1 and "torch sees no CUDA GPU" in errors[0], result.stderr


def test_a_bad_device_or_precision_names_the_flag(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(HOME=str(tmp_path))
    for args, says in (
        (["--device", "gpu0"], "--device: unknown device"),
        (["--precision", "fp8"], "--precision: unknown precision"),
    ):
        result = subprocess.run(
            [sys.executable, "-m", "shoal.peer", "run", *args],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
            check=False,
        )
        assert result.returncode == 2 and says in result.stderr, result.stderr


# ---------------------------------------------------------------- on a GPU


@pytest.mark.gpu
def test_bf16_trains_on_the_gpu() -> None:
    task = make_task(TINY)
    device = torch.device("cuda", 0)
    model = task.make_model(0).to(device)
    inner = InnerOptimizer(
        model, check_hyperparameters({"inner_lr": 3e-3}), device=device, precision="bf16"
    )
    batches = BatchPrefetcher(task.batches(0, 1, 0), device)
    try:
        losses = []
        for i in range(30):
            batch = next(batches)
            assert batch.device == device
            losses.append(inner.step(lambda b=batch: task.loss(model, b), i))
    finally:
        batches.close()
    assert sum(losses[-5:]) < sum(losses[:5])


@pytest.mark.gpu
def test_host_state_of_a_gpu_model_is_pinned_and_deltas_match_the_cpu() -> None:
    cpu = [torch.randn(64, 32), torch.randn(17)]
    cuda = [p.cuda() for p in cpu]
    base = [host_clone(p) for p in cuda]
    assert all(b.is_pinned() and b.device.type == "cpu" for b in base)
    for p, q in zip(cpu, cuda, strict=True):
        p.mul_(0.5)
        q.mul_(0.5)
    out_cpu = [torch.empty(p.shape) for p in cpu]
    out_gpu = [torch.empty(p.shape) for p in cpu]
    delta_into(out_cpu, base, cpu)
    delta_into(out_gpu, base, cuda)
    assert all(torch.equal(a, b) for a, b in zip(out_cpu, out_gpu, strict=True))


@pytest.mark.gpu
def test_the_train_step_bench_reports_the_gpu() -> None:
    bench = Path(__file__).resolve().parents[1] / "bench" / "train_step.py"
    result = subprocess.run(
        [sys.executable, str(bench), "--steps", "5", "--quick"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    report = json.loads(result.stdout)
    assert any(r["device"].startswith("cuda") for r in report["runs"])
