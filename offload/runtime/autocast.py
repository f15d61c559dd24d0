"""Forwards under ``torch.autocast``: the low-precision copies autocast makes of the parameters
are not kept from the forward to the backward.

Note: what autocast holds, and what offload holds instead
    Under ``torch.autocast`` a matmul takes a low-precision copy of its fp32 weight (a cast,
    ``ToCopyBackward0`` when the weight is trainable) and saves that copy for its backward.
    Released or not, every unit's weights then stay on the device as copies from the forward
    to the backward: 2 bytes a parameter of the whole model under bf16, where offload's bound
    is a few units (a 100M-parameter stack of 12 blocks saved 184 MiB of bf16 copies in one
    forward). Autocast's cast cache holds the copies of trainable weights too, until the
    outermost autocast region ends: the whole model's by the end of the forward, also in an
    inference.

    So, during a root forward under autocast on the compute device, autocast's cache is off
    (offload's forward computes what torch computes with ``cache_enabled=False``: a weight
    used twice in one forward is cast twice, and its gradient sums the two in fp32 where the
    cache sums them in the low precision), and, where the forward records a graph and no
    ``saved_tensors_hooks`` of the caller's (``save_on_cpu``) or of a checkpoint around the
    whole model are in place, which decide what is saved themselves, a ``saved_tensors_hooks``
    pair saves a cast of a wrapped parameter as a reference to the parameter; the backward casts
    it again when it needs it. The backward reads the parameter at that point where, without
    autocast, it would read the parameter itself: offload's hooks gather it for its unit's
    backward and update it only after, so the cast is bitwise the forward's. A cast is
    recognized by its autograd history (a trainable parameter) or, for a frozen one (no
    history), by shape and then by its bits against the running unit's frozen parameters (a
    tensor holding the cast's bits is the cast, for the backward: :func:`_is_cast_of`). What
    it costs: the backward casts each saved weight again, as an activation checkpoint's
    recomputation does, and a frozen weight's match casts and compares it once more in the
    forward (``bench_autocast.py``, 8 blocks of 1024 x 4096 on 512 tokens, 2 CPU cores: fwd+bwd
    0.5-3.5% more than with the copies saved where the weights train, 9-12% more where they
    are frozen, 16-18% before the match compared integer words instead of bf16 values; at 4096
    tokens 0.2% and 3%, as the casts do not grow with the tokens). An autocast
    region the model's forward opens (Accelerate's ``mixed_precision``, which wraps
    ``model.forward``) is found at the first unit's forward inside it: the casts of the root's
    layers before that stay saved as copies. Not covered: casts made inside a region
    ``torch.compile`` compiled were not checked (compiled blocks under autocast train with
    torch's numbers, the copies they keep were not counted).

Note: a cast made again
    The backward's cast is the forward's only while the weight has not changed between them.
    torch's own backward through a graph saved before ``optimizer.step()`` (``retain_graph``
    over a step, a GAN loop's slip) raises "modified by an inplace operation", except under
    autocast, where it has the forward's copies; offload cast the stepped weights instead and
    ran silently on them (1.7e-2 off torch's weights after two steps; a scratch probe of
    2026-12-08). The parameter's version counter (which ``step()`` moves, as torch's in-place
    update does) is kept with the reference and checked at the cast: a change is torch's error,
    naming the parameter, where torch would have run on the copy.

Note: fp16 autocast needs a loss scale
    Under ``torch.autocast(dtype=torch.float16)`` the activations' gradients are fp16: those
    below 2**-24 are flushed to zero (a 3-layer MLP whose loss was scaled by 1e-6: every
    weight gradient 0, where a scale of 2**16 lost 1% of its elements). torch's
    ``GradScaler`` cannot reach the gradients where offload holds them (it can where they stay
    in ``p.grad``: CPU device, fp32, optimizer on the CPU), so offload scales the loss itself
    when the config asks (``loss_scale.enabled: true``: ``optimizer.scale_loss``, overflow
    checks and skipped steps as with fp16 compute: the check reads the fp32 gradients the step
    would apply, an inf or NaN of an fp16 gradient carried into them). A forward with gradients
    under fp16 autocast on the compute device without a loss scaler, where offload holds the
    gradients, says so, once (``begin_forward``). Where they stay in ``p.grad``, scaling them
    is torch's ``GradScaler``'s, which offload cannot see, and nothing is said (as in torch).
"""

from __future__ import annotations

import logging

import torch

from offload.runtime.units import UnitRun

logger = logging.getLogger("offload.runtime")


class _CastOf:
    """What is saved for a cast of ``param`` (or a view of the cast: a linear's ``weight.t()``),
    with the parameter's version then (Note: a cast made again)."""

    __slots__ = ("param", "dtype", "view", "version", "name")

    def __init__(
        self, param: torch.Tensor, dtype: torch.dtype, saved: torch.Tensor, name: str
    ) -> None:
        self.param, self.dtype, self.name = param, dtype, name
        self.version = param._version
        self.view = (
            (saved.size(), saved.stride(), saved.storage_offset())
            if saved._base is not None
            else None
        )

    def cast(self) -> torch.Tensor:
        if self.param._version != self.version:
            raise RuntimeError(
                "one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: the parameter {self.name} is at version "
                f"{self.param._version}; expected version {self.version} instead. Under "
                "torch.autocast offload casts a weight again in the backward rather than keep "
                "autocast's copy from the forward, and the weight changed since that forward "
                "(optimizer.step(), or a write into it): torch would have used the copy of "
                "before the change. Run the backward before the step, or the forward again"
            )
        out = self.param.to(self.dtype)
        return out if self.view is None else out.as_strided(*self.view)


class AutocastSaves:
    """The saved-tensor hooks of one runtime's root forwards under autocast (module Note)."""

    def __init__(self, runs: list[UnitRun], device: torch.device) -> None:
        self.device_type = device.type
        self.trainable = {id(p): p for run in runs for p in run.unit.trainable_params}
        self.names = {id(s.param): s.name for run in runs for s in run.unit.layout.segments}
        # per unit index: its frozen parameters by shape, what a frozen cast is matched to
        self.frozen: dict[int, dict[torch.Size, list[torch.Tensor]]] = {}
        for run in runs:
            by_shape = self.frozen.setdefault(run.unit.index, {})
            for s in run.unit.layout.segments:
                if not s.trainable and s.param.is_floating_point():
                    by_shape.setdefault(s.param.shape, []).append(s.param)
        self.root = runs[0].unit.index
        self.hooks = (self._pack, self._unpack)
        self._context = None  # the pushed saved_tensors_hooks, during a root forward
        self._cache: bool | None = None  # autocast's cache setting the root forward found
        self._unit = self.root  # the index of the unit whose forward runs
        # set by the optimizer: no loss scaler, and the gradients out of GradScaler's reach (see
        # Note: fp16 autocast needs a loss scale); fp16 autocast is then said once
        self.warn_unscaled_fp16 = False
        self._said_unscaled = False

    def begin_forward(self) -> None:
        """A root forward begins: under autocast on the compute device, its cast cache is off
        for the forward, and where the forward records a graph and nobody else's saved-tensor
        hooks are in place, the hooks go in."""
        if not torch.is_autocast_enabled(self.device_type):
            return
        if self._cache is None:
            self._cache = torch.is_autocast_cache_enabled()
            torch.set_autocast_cache_enabled(False)
            self._say_unscaled_fp16()
        # (asked again at each unit: one inside a checkpoint has the checkpoint's hooks)
        if self._context is None and torch.is_grad_enabled() and _hooks_free():
            self._context = torch.autograd.graph.saved_tensors_hooks(*self.hooks)
            self._context.__enter__()

    def end_forward(self) -> None:
        """The root forward returned, raised or was stopped: the cache's setting comes back and
        the hooks come out (only when they are on top: what was pushed after them and left
        is not taken out with them)."""
        if self._cache is None:
            return
        if torch.is_autocast_enabled(self.device_type):  # (else its region ended, and set it)
            torch.set_autocast_cache_enabled(self._cache)
        self._cache = None
        self._unit = self.root
        if self._context is not None:
            top = _saved_tensors_hooks()
            if top is not None and top[0] == self.hooks[0]:
                self._context.__exit__(None, None, None)
            self._context = None

    def _say_unscaled_fp16(self) -> None:
        """A forward with gradients under fp16 autocast and no loss scaler (Note: fp16
        autocast needs a loss scale), said once."""
        if not self.warn_unscaled_fp16 or self._said_unscaled or not torch.is_grad_enabled():
            return
        if torch.get_autocast_dtype(self.device_type) != torch.float16:
            return
        self._said_unscaled = True
        logger.warning(
            "offload: a forward under torch.autocast(dtype=torch.float16) with no loss scaling: "
            "its fp16 gradients below 2**-24 become 0, and torch.amp.GradScaler cannot reach "
            "the gradients offload holds. Set the config's loss_scale.enabled: true and call "
            "optimizer.scale_loss(loss).backward() (overflowing steps are then skipped), or "
            "use dtype=torch.bfloat16; said once"
        )

    def unit_begins(self, run: UnitRun, in_model: bool) -> None:
        """A unit's forward begins (``in_model``: inside the root forward). An autocast region
        the model's forward opened after the root forward began (Accelerate's mixed precision
        wraps ``model.forward`` in one, inside the call's hooks) is found here."""
        if in_model:
            self.begin_forward()
        self._unit = run.unit.index

    def unit_ends(self) -> None:
        self._unit = self.root

    def _pack(self, saved: torch.Tensor):
        base = saved if saved._base is None else saved._base
        param = self._cast_source(base)
        return saved if param is None else _CastOf(param, base.dtype, saved, self.names[id(param)])

    @staticmethod
    def _unpack(packed):
        return packed.cast() if isinstance(packed, _CastOf) else packed

    def _cast_source(self, t: torch.Tensor) -> torch.Tensor | None:
        """The wrapped parameter ``t`` is a cast of, or None."""
        fn = t.grad_fn
        if fn is not None:
            if fn.name() != "ToCopyBackward0":
                return None
            edge = fn.next_functions[0][0]
            p = self.trainable.get(id(getattr(edge, "variable", None)))
            return p if p is not None and p is edge.variable and p.dtype != t.dtype else None
        if t.requires_grad or not t.is_floating_point():
            return None
        for p in self.frozen[self._unit].get(t.shape, ()):
            if p.dtype != t.dtype and _is_cast_of(t, p):
                return p
        return None


def _is_cast_of(t: torch.Tensor, p: torch.Tensor) -> bool:
    """Whether ``t`` holds exactly the bits of ``p.to(t.dtype)``. The first elements decide
    first (a block's same-shaped weights, q and o or gate and up, are told apart without
    casting the wrong one whole); then the whole cast, compared as integer words: the same
    test as the values' but for a zero's sign or a NaN's payload (the bits the backward's
    cast gives back), and ~6x faster than ``torch.equal`` on bf16 values (4M elements on this
    2-core CPU: 0.60 ms against 3.6 ms; with the cast, 1.5 ms against 5.4 ms)."""
    head = min(t.numel(), _HEAD)
    tf, pf = t.reshape(-1), p.reshape(-1)
    if not torch.equal(_words(tf[:head]), _words(pf[:head].to(t.dtype))):
        return False
    return torch.equal(_words(tf), _words(pf.to(t.dtype)))


_HEAD = 64  # elements compared before a whole cast is made


def _words(flat: torch.Tensor) -> torch.Tensor:
    """A flat contiguous tensor's bits as the widest integers its size and offset allow."""
    size, offset = flat.numel() * flat.itemsize, flat.storage_offset() * flat.itemsize
    for w in (torch.int64, torch.int32, torch.int16):
        if size % w.itemsize == 0 and offset % w.itemsize == 0:
            return flat.view(w)
    return flat.view(torch.uint8)


def _hooks_free() -> bool:
    """Whether hooks may go in: none in place, and not disabled
    (``torch.autograd.graph.disable_saved_tensors_hooks``, as ``torch.func``'s transforms do:
    pushing any there raises)."""
    return _saved_tensors_hooks() is None and torch._C._autograd._saved_tensors_hooks_is_enabled()


def _saved_tensors_hooks():
    """The innermost ``saved_tensors_hooks`` in place on this thread (pack, unpack), or None
    (private in torch; what ``torch.autograd.graph`` reads it with)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False)
