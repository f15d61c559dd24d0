"""What code outside offload did to the wrapped model's parameters between offload's uses.

offload owns the parameters' storage from ``wrap`` on: it fills a unit's storage at each gather,
frees it at each release and updates it (or the master it is derived from) at each step. Code
that changes the parameters behind offload's back (a module replaced after wrap, an ``nn.init``
or a write through ``p.data`` into released storage, ``p.data = t``, a trainable head added to
the model) would otherwise train apart from torch with no error; a read of released storage
computed with zeros. :class:`ModelWatch` looks at what happened since it last looked, at each
forward's start, ``optimizer.step()``, ``state_dict()``, ``save_pretrained`` and ``export``
(the runtime calls it; parameters that stay on the device with their master apart also at a
unit's first use in a forward after its update, :meth:`ModelWatch.check_pieces`), says it
once, and leaves offload's values in place. The unit's own view of its storage (versions,
views, touched pages, the device pieces' fingerprints) is the :class:`UnitRun`'s; this is the
model-wide walk over them.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch.nn as nn

from offload.homes.params import ParamHome
from offload.plan import Placement
from offload.runtime.phase import PhaseError
from offload.runtime.units import UnitRun


class ModelWatch:
    """The checks of one wrapped model's parameters against what offload holds (the module
    docstring), and what they said already."""

    __slots__ = (
        "model",
        "runs",
        "params",
        "owned",
        "master_apart",
        "_derive_again",
        "_differ",
        "_flush",
        "_merge_refused",
        "_added_said",
        "_failed_writes",
    )

    def __init__(
        self,
        model: nn.Module,
        runs: list[UnitRun],
        params: ParamHome,
        placement: Placement,
        derive_again: Callable[[list[UnitRun]], None],
        differ: Callable[[UnitRun, list[str]], list[str]],
        flush: Callable[[], None],
    ) -> None:
        self.model, self.runs, self.params = model, runs, params
        # the ids of the parameters offload holds (the conversion guard's and _warn_added's)
        self.owned = {id(s.param) for r in runs for s in r.unit.layout.segments}
        self.master_apart = master_apart(placement)
        # gives the trainable parameters of units written through the tensor the values
        # derived from their master again (where the master is apart: check_unwritten)
        self._derive_again = derive_again
        # of a gathered unit's names seen in its pieces' fingerprints (``offload.homes.
        # piece_prints``, Note on writes by code outside offload), the trainable ones whose
        # values differ from those derived from their master (check_pieces)
        self._differ = differ
        self._flush = flush  # waits for a running update (check_pieces)
        self._merge_refused = False  # a PEFT merge_adapter() was refused (check_in_model)
        self._added_said: tuple[str, ...] = ()  # the parameters added after wrap, warned of
        # the names written into released units during a forward that raised, by unit: named
        # at the next check (forward_failed)
        self._failed_writes: dict[UnitRun, list[str]] = {}

    def check_in_model(self, what: str, pieces: bool = False) -> None:
        """Every parameter offload holds is still one of the model's. A module replaced or
        removed after wrap (PEFT's ``merge_and_unload()`` puts each LoRA layer's base layer in
        its place) left offload's homes, hooks and optimizer with parameters the model no
        longer has: ``merge_and_unload`` had read the adapters and base weights themselves,
        the released storage's zeros, and written the merge there, so the merged model ran
        (and Hugging Face's ``save_pretrained`` saved it) without the adapters, 0.26 off the
        merged weights, and ``offload.save_pretrained`` raised a bare ``KeyError``. Refused
        instead at the next forward, step, ``model.state_dict()``, ``save_pretrained`` or
        ``export``; a checkpoint and ``optimizer.state_dict()``, which read offload's own
        records, still save the trained values. The walk reads the modules' own
        ``_parameters``: ``model.parameters()`` would wait for a running update. Where the
        parameters are released, PEFT's ``merge_adapter()`` (which leaves the layers in
        place) merged zeros the same way, and its layers then skipped their adapters: the
        logits 0.41 off, no error; refused likewise while a layer says it is merged."""
        params = [p for m in self.model.modules() for p in m._parameters.values() if p is not None]
        held = {id(p) for p in params}
        gone = [
            s.name for r in self.runs for s in r.unit.layout.segments if id(s.param) not in held
        ]
        if gone:
            raise PhaseError(
                f"offload: {what} refused: {len(gone)} parameter(s) that offload holds are no "
                f"longer in the model ({', '.join(gone[:3])}{', ...' if len(gone) > 3 else ''}): "
                "a module was replaced or removed after offload.wrap (PEFT's merge_and_unload() "
                "and unload() do so; a merge reads and writes the parameters themselves, which "
                "offload releases between uses: it merged zeros; transformers' "
                "resize_token_embeddings() replaces an untied output layer), or the parameters "
                "were swapped for a call (torch.func.functional_call, torch.nn.utils.stateless: "
                "not supported on a wrapped model, whose forward computes with offload's own). "
                "Call optimizer.close(restore=True) first, which puts every value back into the "
                "model, then merge_and_unload(); or change the model (a resize too) before "
                "offload.wrap"
            )
        if any(p.requires_grad and id(p) not in self.owned for p in params):
            self._warn_added(what)  # (after the refusal above: a replaced module's are new)
        if self.params.releases:
            merged = [n for n, m in self.model.named_modules() if getattr(m, "merged_adapters", 0)]
            if self._merge_refused and not merged:  # unmerge_adapter() since the refusal:
                self.forget_writes()  # its writes undo the merge's (both into zeros)
            self._merge_refused = bool(merged)
            if merged:  # PEFT's merge_adapter(): its layers now skip the adapters they hold
                self.forget_writes()  # (the merge's writes: this error says so)
                raise PhaseError(
                    f"offload: {what} refused: PEFT adapters were merged into {len(merged)} "
                    f"layer(s) after offload.wrap ({', '.join(merged[:3])}"
                    f"{', ...' if len(merged) > 3 else ''}): merge_adapter() reads and writes "
                    "the weights themselves, which offload releases between uses, so it "
                    "merged zeros and the merged layers would run without the adapters. Call "
                    "unmerge_adapter() (which changes nothing here) to go on; to merge, call "
                    "optimizer.close(restore=True) first (or keep the parameters on the device: "
                    "offload_param.device none)"
                )
        self.check_unwritten(what)
        if pieces:  # (a read of the values: the forwards look unit by unit, check_pieces)
            self.check_pieces(what)

    def _warn_added(self, what: str) -> None:
        """Trainable parameters the model gained after wrap (a head assigned to it) get
        gradients but no step from offload's optimizer, as from a torch optimizer built before
        them, and nothing said so (``p.grad`` kept growing); warned once per set of names, so
        one stepped by an optimizer of its own costs a line."""
        added = tuple(
            f"{name}.{key}" if name else key
            for name, m in self.model.named_modules()
            for key, p in m._parameters.items()
            if p is not None and p.requires_grad and id(p) not in self.owned
        )
        if added == self._added_said:
            return
        self._added_said = added
        warnings.warn(
            f"offload: {len(added)} trainable parameter(s) of the model are not offload's, "
            f"seen at {what} ({', '.join(added[:3])}{', ...' if len(added) > 3 else ''}): "
            "added after offload.wrap, they get gradients, but offload's optimizer does not "
            "step them (as a torch optimizer built before them would not). Add them before "
            "offload.wrap to train them with offload, or step them with an optimizer of their "
            "own",
            stacklevel=3,
        )

    def forget_writes(self) -> None:
        """What was written into released units since the last check is let go (their
        versions noted, their pages given back): a refusal that names its cause said it."""
        self._failed_writes.clear()
        for run in self.runs:
            run.note_versions()
            run.touched()
            run.overwritten()

    def forward_failed(self) -> None:
        """A root forward raised, with units released that code outside them touched in it
        (``UnitRun.touched``): a read is let go, since that forward's values are gone (read
        again by the next forward, it is named at the unit's gather there); before
        2026-12-06 it was warned of at the next forward as read between uses, naming a read
        the caller never made between uses. A write is kept for the next check to name."""
        for run in self.runs:
            if self.params.gathered(run.unit):  # (its storage holds values: check_pieces')
                continue
            wrote, _ = run.touched()
            if wrote:
                self._failed_writes.setdefault(run, []).extend(wrote)

    def check_unwritten(self, what: str) -> None:
        """No parameter of a released unit was written in place (``nn.init`` or
        ``model.apply(init)`` after ``wrap``, ``p.copy_(...)`` under ``no_grad``, WGAN's
        ``p.data.clamp_``): the write went to the released storage, which the next gather
        fills from the unit's home, so it was dropped with no error (and ``state_dict()`` gave
        the values of before). A write through the tensor moves its version counter; one
        through ``p.data`` does not, and is seen in the released pages it wrote
        (``UnitRun.touched``; before 2026-12-06 it was not seen: 0.012 off torch's losses in
        three steps of WGAN's clipping, at every placement that releases). A write in a
        forward (a ``clamp_`` under ``no_grad``, ``F.embedding``'s ``max_norm``;
        ``nn.Embedding(max_norm=...)`` is refused at wrap) goes into the gathered copy and is
        dropped at its release the same way. Said once: the versions are noted again, the
        pages given back, and training goes on with offload's values. A unit that stays
        gathered is live storage: on the device with the master a copy (:func:`master_apart`)
        its trainable parameters are looked at too (through their versions here, a write
        through ``p.data`` by :meth:`check_pieces`), and derived from the master again;
        otherwise (the parameters are the master; a persistent unit between its first use and
        the step) not.
        A released parameter read between uses gives a warning (the read gave zeros); one
        given another tensor (``p.data = t``) is refused first (:meth:`_check_replaced`)."""
        self._check_replaced(what)
        apart = self.master_apart
        by_run, read, paged = {}, [], []  # the written parameters' names, by unit; those
        # read; those written seen in the released pages alone (through p.data)
        for run in self.runs:
            gathered = self.params.gathered(run.unit)
            if apart or not gathered:
                names = run.written(trainable_only=gathered)
                if gathered:  # (writes through p.data: check_pieces)
                    by_run[run] = names
                    continue
                wrote, looked = run.touched()
                wrote = dict.fromkeys(self._failed_writes.pop(run, []) + wrote)
                seen = [n for n in wrote if n not in names]  # in the pages alone
                paged += seen
                by_run[run] = names + seen
                read += looked
        written = [n for names in by_run.values() for n in names]
        # (a page holds neighbours too: written ones seen only there may not all have been)
        pages = (
            f"; {len(paged)} of them seen in the pages written, and a page, 4 KiB or a 2 MiB "
            "huge page, may hold parameters beside the one written"
            if paged
            else ""
        )
        if read:
            warnings.warn(
                f"offload: released parameters were read between uses, before {what} (the "
                f"pages of {', '.join(read[:5])}{', ...' if len(read) > 5 else ''}; a page, 4 "
                "KiB or a 2 MiB huge page, may hold several parameters): between uses their "
                "storage is freed, and a read gives zeros. Read values through "
                "model.state_dict()",
                stacklevel=3,
            )
        if written:
            self._refuse(what, by_run, pages)

    def check_pieces(self, what: str, run: UnitRun | None = None) -> None:
        """Where the parameters stay on the device with their master apart, none of ``run``'s
        (of every unit, once a running update is done, when None) was written through
        ``p.data`` since offload last wrote it: seen in the fingerprints of its pieces and
        narrowed to the parameters whose values differ from their master's (``offload.homes.
        piece_prints``, Note on writes by code outside offload; before 2026-12-06 not seen, and the next update
        wrote over the write), or in a piece an update wrote over meanwhile. A forward looks
        at each unit as it uses it, once its update is done (at the forward's start a unit's
        update may still run after ``step()``), the first time after each update or load
        (``ParamHome.looked``: a write after it is seen by the next update, in the piece, on
        the CPU);
        ``model.state_dict()``, ``save_pretrained`` and ``export`` at every unit. Refused as
        :meth:`check_unwritten` refuses."""
        if not self.master_apart or (run is not None and self.params.looked(run.unit)):
            return
        if run is None:
            self._flush()
        by_run, over = {}, []
        for r in self.runs if run is None else [run]:
            wrote, _ = r.touched()
            seen = self._differ(r, wrote) if wrote else []
            gone = [n for n in r.overwritten() if n not in seen]
            over += gone
            if seen or gone:
                by_run[r] = seen + gone
        if by_run:
            more = (
                f"; {len(over)} of them seen in a piece an update then wrote over, which may "
                "hold parameters beside the one written (a write after the unit's first use "
                "since the last step, or right after optimizer.step() while its update still "
                "ran: it lasts no longer than one before the step)"
                if over
                else ""
            )
            self._refuse(what, by_run, more)

    def _refuse(self, what: str, by_run: dict[UnitRun, list[str]], more: str) -> None:
        """Raises for the parameters ``by_run`` names (once: the versions noted again; where
        the master is apart the units' parameters get its values again)."""
        written = [n for names in by_run.values() for n in names]
        apart = self.master_apart
        if apart:  # (every unit is gathered there: its names are trainable ones)
            runs = [run for run, names in by_run.items() if names]
            self._derive_again(runs)
            for run in runs:  # (what the derivation wrote over is said here)
                run.overwritten()
        for run in self.runs:
            run.note_versions()
        why = (
            "the parameters stay on the device while their fp32 master is a copy elsewhere "
            "(offload_param.device none with bf16 compute, the optimizer on NVMe or a CUDA "
            "device): an nn.init call, model.apply(...), a copy_ under no_grad or a write "
            "through p.data (WGAN's p.data.clamp_) changes the device copy alone, and the "
            "next update writes the values derived from the master over it"
            if apart
            else "an nn.init call, model.apply(...), a copy_ under no_grad or a write through "
            "p.data (WGAN's p.data.clamp_) between uses writes into freed storage, and a "
            "write in the model's forward (a clamp_ under no_grad, F.embedding's max_norm) "
            "into the copy that forward computes with; the next gather refills both from "
            "offload's copy"
        )
        raise PhaseError(
            f"offload: {what}: {len(written)} parameter(s) were written in place after "
            f"offload.wrap ({', '.join(written[:3])}{', ...' if len(written) > 3 else ''}"
            f"{more}): {why}, so the write is dropped (the parameters keep offload's values). "
            "Initialize the model before offload.wrap, set values with "
            "model.load_state_dict(...) (to clip weights after a step: change "
            "model.state_dict() and load it), and keep forwards from writing their weights"
        )

    def _check_replaced(self, what: str) -> None:
        """No parameter was given another tensor through ``p.data = ...``: it would be neither
        filled nor trained (the step updated offload's storage while the model computed with
        the new tensor, silently, also where the parameters are the master: 0.0024 off torch's
        losses in three steps at none/cpu, a scratch probe of 2026-12-06). Refused once; the
        parameters view offload's storage again, with offload's values."""
        replaced = [(run, run.replaced()) for run in self.runs]
        names = [n for _, names in replaced for n in names]
        if names:
            resized = [
                f"{s.name} {list(s.shape)} -> {list(s.param.shape)}"
                for run, some in replaced
                for s in run.unit.layout.segments
                if s.name in some and s.param.shape != s.shape
            ]
            for run, some in replaced:
                if some:
                    run.restore()
            if resized:  # transformers' resize_token_embeddings() sets the new table so
                raise PhaseError(
                    f"offload: {what}: {len(resized)} parameter(s) were resized after "
                    f"offload.wrap ({', '.join(resized[:3])}{', ...' if len(resized) > 3 else ''}"
                    "; transformers' resize_token_embeddings() does so, through p.data = ...): "
                    "offload holds each parameter at the shape it had at wrap, so the new "
                    "tensor would be neither filled nor trained. They view offload's storage "
                    "again, at their old shape, with offload's values; what else the resize "
                    "changed (a model config's vocab_size) is not put back. Resize before "
                    "offload.wrap (or close(restore=True), resize, and wrap again)"
                )
            raise PhaseError(
                f"offload: {what}: {len(names)} parameter(s) were given another tensor through "
                f"p.data = ... after offload.wrap ({', '.join(names[:3])}"
                f"{', ...' if len(names) > 3 else ''}; torch.nn.utils.vector_to_parameters "
                "does so): offload computes with and updates the "
                "storage it gave them, so the new tensor would be neither filled nor trained. "
                "They view offload's storage again, with offload's values. Set values with "
                "model.load_state_dict(...), or before offload.wrap"
            )


def master_apart(placement: Placement) -> bool:
    """Whether the parameters stay on the device (``offload_param.device: none``, one rank)
    while their fp32 master is a copy elsewhere (host or NVMe: bf16 compute, the optimizer
    on NVMe, or a CUDA device). A write into such a parameter lasted only until the next
    update wrote the values derived from the master over it: ``nn.init`` after wrap with
    the optimizer on NVMe trained silently 0.24 off torch after two steps (a scratch probe,
    2026-12-06). Where the master is the parameters' own storage (fp32 with both on the
    CPU) the write is the master's and lasts, as in torch. Several ranks: not checked (the
    values are derived again through the ranks' collectives, which one rank's write could
    not start)."""
    return placement.master_apart_from_device_params and placement.world == 1
