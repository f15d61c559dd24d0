"""The device interface: counted host <-> device copies, the pinning policy, and (with a GPU)
copies on the process's streams without a device-wide synchronize."""

from __future__ import annotations

import pytest
import torch

from offload.device import COMPLETED, Copier, HostMemory, Transfers, fingerprint, for_device


def test_transfers_count_every_crossing_on_the_cpu():
    t = Transfers(torch.device("cpu"))
    src = torch.arange(10, dtype=torch.float32)
    dst = torch.empty(10)
    event = t.to_device([(dst[:4], src[:4]), (dst[4:], src[4:])])
    assert event.done() and torch.equal(dst, src)
    host = torch.empty(10)
    t.to_host(host, dst).wait()
    t.count("device->host", 6)
    st = t.stats()["tiers"]
    assert st["host->device"] == {"bytes": 40, "transfers": 2, "wait_seconds": 0.0}
    assert st["device->host"]["bytes"] == 46 and st["device->host"]["transfers"] == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_fingerprint_is_of_the_bits_alone_and_moves_with_any_single_change(dtype):
    """``fingerprint`` (``offload.homes.piece_prints``, Note on writes by code outside offload) gives the same
    value for the same bits wherever they sit (the staging slot on CUDA, the device buffer at
    any offset: an unaligned one is copied first, and a length that is not a whole number of
    8-byte words ends in a shorter word), and another value for one element changed by an ulp,
    for a clamp and for zeros written where there were values."""
    g = torch.Generator().manual_seed(0)
    base = torch.randn(4099, generator=g).to(dtype)
    for lo, hi in [(0, 4099), (1, 4096), (3, 4098), (4, 4095), (0, 3)]:
        piece = base[lo:hi]
        value = int(fingerprint(piece))
        assert value == int(fingerprint(piece.clone()))  # (aligned, apart)
        staged = torch.empty(hi - lo + 8, dtype=dtype)[1:][: hi - lo]  # another offset
        staged.copy_(piece)
        assert value == int(fingerprint(staged))
        for i in {0, (hi - lo) // 2, hi - lo - 1}:
            nudged = piece.clone()
            bits = nudged.view(torch.int16 if dtype.itemsize == 2 else torch.int32)
            bits[i] += 1  # one ulp
            assert int(fingerprint(nudged)) != value, (lo, hi, i)
    assert int(fingerprint(base.clamp(-0.5, 0.5))) != int(fingerprint(base))
    zeroed = base.clone()
    zeroed[100:200] = 0
    assert int(fingerprint(zeroed)) != int(fingerprint(base))


def test_one_copier_per_device_per_process():
    assert Copier.of("cpu") is Copier.of(torch.device("cpu"))
    assert Transfers(torch.device("cpu")).copier is Transfers(torch.device("cpu")).copier


def test_pinning_is_decided_in_one_place():
    cpu = HostMemory(torch.device("cpu"))
    assert not cpu.pins(True) and not cpu.empty(8, torch.float32, pin=True).is_pinned()
    memory, staging, writer = for_device(torch.device("cpu"))
    assert not memory.pins(True)
    w = writer(Transfers(torch.device("cpu")), memory, torch.float32)
    flat = torch.zeros(8)
    w.out(flat, 2, 6).fill_(1.0)  # on the CPU the optimizer writes the device buffer itself
    w.commit(flat, 2, 6)
    assert flat.tolist() == [0, 0, 1, 1, 1, 1, 0, 0] and COMPLETED.done()


@pytest.mark.parametrize("world", [2, 1])
def test_a_reduced_share_reaches_the_host_in_its_own_dtype(world):
    """CUDA's gradient staging, run on the CPU: a unit's fp32 share of a sum over ranks (a
    reduce dtype wider than the bf16 compute dtype) crosses through the pinned buffer's bytes
    whole; copied into the bf16 buffer it was rounded back to bf16. A one-rank group's share
    is larger than that buffer: it gets one of its own."""
    from offload.device.memory import CudaGradStaging  # noqa: PLC0415

    largest = 4096
    cpu = torch.device("cpu")
    staging = CudaGradStaging(Transfers(cpu), HostMemory(cpu), torch.bfloat16, largest)
    share = torch.linspace(1.0, 2.0, largest // world, dtype=torch.float32) + 1e-4
    for _ in range(2):  # (the buffer of its own is made once)
        host = staging.share_to_host(share)
        assert host.dtype == torch.float32 and torch.equal(host, share)
    st = staging.transfers.stats()["tiers"]["device->host"]
    assert st["bytes"] == 2 * 4 * share.numel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_round_trip_without_device_synchronize(monkeypatch):
    """Streams + events on a real GPU: data intact, and no device-wide synchronize anywhere."""

    def forbidden(*_a, **_k):
        raise AssertionError("torch.cuda.synchronize() called")

    monkeypatch.setattr(torch.cuda, "synchronize", forbidden)
    memory, _, writer = for_device(torch.device("cuda"))
    assert memory.pins(True)
    t = Transfers(torch.device("cuda"))
    host = memory.empty(4099, torch.float32, pin=True)
    host.copy_(torch.randn(4099))
    dev = torch.empty(4099, device="cuda")
    t.to_device([(dev, host)])  # the compute stream is ordered after the copy
    dev.mul_(2)
    back = memory.empty(4099, torch.float32, pin=True)
    t.wait(t.to_host(back, dev), "device->host")
    assert torch.equal(back, host * 2)
    w = writer(t, memory, torch.float32)
    for lo in range(0, 4099, 1000):  # two staging slots, reused while copies are in flight
        hi = min(lo + 1000, 4099)
        w.out(dev, lo, hi).copy_(host[lo:hi])
        w.commit(dev, lo, hi)
    w.quiesce()
    assert torch.equal(dev.cpu(), host)


def test_a_pin_the_host_refuses_names_what_to_change():
    """On CUDA a host buffer asked to be pinned is page-locked; where the host refuses (here:
    no GPU at all, on a GPU host: RAM or a container's locked-memory limit) the error says
    which settings to lower instead of torch's bare RuntimeError."""
    if torch.cuda.is_available():
        pytest.skip("pins for real with a GPU")
    cuda = HostMemory(torch.device("cuda"))
    assert cuda.pins(True) and not cuda.pins(False)
    assert not cuda.empty(8, torch.float32, pin=False).is_pinned()
    with pytest.raises(MemoryError, match=r"32 bytes.*offload_param.pin_memory: false"):
        cuda.empty(8, torch.float32, pin=True)


def test_a_pinned_buffer_is_asked_for_its_exact_size(monkeypatch):
    """torch's pinned allocator rounds up to a power of two and returns page-aligned memory:
    a pinned aligned buffer asks for exactly its bytes (with the 4095 bytes that align an
    unpinned one, a pool of 1 MiB took a pinned block of 2 MiB)."""
    from offload.io import aligned  # noqa: PLC0415

    asked = []

    def fake(nbytes, pin):  # page-aligned, as cudaHostAlloc's memory is
        asked.append((nbytes, pin))
        return aligned._huge_page_mapping(aligned.round_up(nbytes))[:nbytes]

    monkeypatch.setattr(aligned, "_allocate", fake)
    out = aligned.aligned_empty(1 << 20, pin=True)
    assert asked == [(1 << 20, True)] and out.numel() == 1 << 20 and aligned.is_aligned(out)


# ---------------------------------------------------------------- the CUDA branches' order
class _Late:
    """A copy's event that has not completed until someone waits on it (as a CUDA event
    behind a busy stream); says when it was waited."""

    def __init__(self, log: list, name: str) -> None:
        self.log, self.name, self.waited = log, name, False

    def done(self) -> bool:
        return self.waited

    def wait(self) -> None:
        self.log.append(("wait", self.name))
        self.waited = True


class _RecordingCopier(Copier):
    """The CUDA copier's calls, written down instead of queued: each thread's "current
    stream" is its name (a worker thread's is not the captured one); copies happen at once
    but their events are late."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.log: list = []
        self.copies = 0

    def current_stream(self):
        import threading  # noqa: PLC0415

        return threading.current_thread().name

    def fence(self, stream):
        self.log.append(("fence", stream))
        return ("fence", stream)

    def order_after(self, stream, event) -> None:
        self.log.append(("order_after", stream, event.name))

    def _copy(self, kind, dst, src, after):
        self.copies += 1
        dst.copy_(src)
        self.log.append((kind, after, f"e{self.copies}"))
        return _Late(self.log, f"e{self.copies}")

    def to_device(self, dst, src, after):
        return self._copy("to_device", dst, src, after)

    def to_host(self, dst, src, after):
        return self._copy("to_host", dst, src, after)


def _recording_transfers() -> tuple[Transfers, _RecordingCopier]:
    t = Transfers(torch.device("cpu"))
    t.copier = copier = _RecordingCopier()
    t.capture_stream()  # this (main) thread's stream is the compute stream
    return t, copier


def test_copies_are_fenced_and_ordered_on_the_captured_stream_from_any_thread():
    """Transfers' contract with the copier (copier.py's Note): a copy to the device waits for a
    fence of the compute stream recorded before it, and the compute stream then waits for the
    last copy; a copy to the host waits for a fence. Both use the stream captured at hook
    time, also when the call comes from the update's worker thread."""
    import threading  # noqa: PLC0415

    t, copier = _recording_transfers()
    main = threading.current_thread().name
    src, dst = torch.arange(8.0), torch.empty(8)
    worker = threading.Thread(target=lambda: t.to_device([(dst[:4], src[:4]), (dst[4:], src[4:])]))
    worker.start()
    worker.join()
    fence = ("fence", main)
    assert copier.log == [
        fence,
        ("to_device", fence, "e1"),
        ("to_device", fence, "e2"),
        ("order_after", main, "e2"),  # the last copy's event covers the earlier ones (FIFO)
    ]
    copier.log.clear()
    event = t.to_host(torch.empty(8), dst)
    assert copier.log == [fence, ("to_host", fence, "e3")] and not event.done()


def test_the_writer_reuses_a_pinned_slot_only_after_its_copy():
    """CUDA's device writer: two pinned slots; writing into one first waits for the copy that
    last read it (the commit two before), never for nothing, and quiesce waits for both."""
    from offload.device.memory import CudaDeviceWriter  # noqa: PLC0415

    t, copier = _recording_transfers()
    w = CudaDeviceWriter(t, HostMemory(torch.device("cpu")), torch.float32)
    flat = torch.zeros(12)
    for j in range(3):
        w.out(flat, 4 * j, 4 * j + 4).fill_(j + 1.0)
        w.commit(flat, 4 * j, 4 * j + 4)
        waits = [e for e in copier.log if e[0] == "wait"]
        assert waits == ([("wait", "e1")] if j == 2 else []), (j, copier.log)
    assert flat.tolist() == [1.0] * 4 + [2.0] * 4 + [3.0] * 4
    copier.log.clear()
    w.quiesce()
    assert sorted(copier.log) == [("wait", "e2"), ("wait", "e3")]


def test_a_gradient_share_is_read_on_the_host_only_after_its_copy():
    """CUDA's gradient staging hands the host a pinned buffer only once the copy into it has
    completed (the host reads it next, and the next call overwrites it)."""
    from offload.device.memory import CudaGradStaging  # noqa: PLC0415

    t, copier = _recording_transfers()
    staging = CudaGradStaging(t, HostMemory(torch.device("cpu")), torch.float32, 64)
    host = staging.share_to_host(torch.ones(32))
    assert copier.log[-1] == ("wait", "e1") and torch.equal(host, torch.ones(32))


@pytest.mark.parametrize("pin", [True, False])
def test_unpinned_param_homes_on_cuda_are_warned_of(monkeypatch, caplog, tmp_path, pin):
    """With CUDA, gathers from pageable memory wait for the compute queued before them
    (CUDA stages such copies with the host waiting for the stream): wrap says so when
    ``offload_param.pin_memory`` is false. A CUDA device stood in for by a CPU policy that
    says it is CUDA and pins nothing."""
    import importlib  # noqa: PLC0415
    import logging  # noqa: PLC0415

    from engine_models import make_model, placement_config  # noqa: PLC0415

    import offload  # noqa: PLC0415

    wrap_mod = importlib.import_module("offload.api.wrap")  # (the package exports the function)

    class SaysCuda(HostMemory):
        is_cuda = True

        def __init__(self, device) -> None:
            pass

        def pins(self, wanted: bool) -> bool:
            return False

    real = wrap_mod.for_device
    monkeypatch.setattr(
        wrap_mod, "for_device", lambda device: (SaysCuda(device), *real(device)[1:])
    )
    cfg = placement_config("cpu", "cpu", tmp_path)
    cfg["offload_param"]["pin_memory"] = pin
    with caplog.at_level(logging.WARNING, logger="offload.api"):
        _, opt = offload.wrap(make_model(), cfg)
        opt.close()
    warned = [r for r in caplog.records if "pin_memory=false with CUDA" in r.getMessage()]
    assert len(warned) == (0 if pin else 1)


def test_only_memory_a_copy_reads_or_writes_asks_to_be_pinned(tmp_path):
    """The param homes' host memory is what the gathers copy from: pinned as
    ``offload_param.pin_memory`` says. Nothing copies to or from the optimizer's (the
    gradients cross through the staging's own pinned buffer): it never asks, whatever
    ``offload_optimizer.pin_memory`` says, so its NVMe swap pool keeps its huge pages and its
    buffers are not rounded up to a power of two by torch's pinned allocator."""
    from engine_models import make_model, placement_config  # noqa: PLC0415

    from offload.config import load_config  # noqa: PLC0415
    from offload.plan import make_plan  # noqa: PLC0415

    for wanted in (True, False):
        cfg = placement_config("cpu", "nvme", tmp_path)
        cfg["offload_param"]["pin_memory"] = wanted
        cfg["offload_optimizer"]["pin_memory"] = True
        pin = make_plan(make_model(), load_config(cfg)).placement.pin
        assert pin == {"offload_param": wanted, "offload_optimizer": False}
