"""Per-layer readiness on the GPU: every layer's load issued at once on a side stream, each
layer's compute waiting on the GPU for its own layer; layer-wise saves started as soon as
their layer's KV is written. The host never waits, so a whole step (loads, forward pass and
saves) can be captured in one CUDA graph.

How it works on CUDA: :meth:`LayerwiseLoad.start` makes a side stream wait for everything
already queued on the forward's stream (the engine's earlier writes), then queues one
``prepared.load(..., layers=[l])`` per layer on it, each followed by a CUDA event.
:meth:`LayerwiseLoad.wait` makes the *current* stream wait for that event: a GPU-side wait,
and inside a stream capture an edge of the graph (layer ``l``'s compute node depends on
layer ``l``'s load node, nothing else). :class:`LayerwiseSave` is the mirror: its
:meth:`~LayerwiseSave.save` makes the side stream wait for the forward's stream as it is
when called (right after the layer's attention wrote its KV), then stores that layer.

Why events and not a flag polled by a wait kernel: an event costs no launch and no SM (in a
graph it is an edge; eagerly ``cudaEventRecord`` + ``cudaStreamWaitEvent``, about a
microsecond of host time each), cannot deadlock, and keeps the loads ordinary launches
(their errors, CTA cap and copy path stay as documented). A flag written by the load kernel
would allow one launch for all layers, but needs a spinning kernel that holds an SM per wait
and a kernel change; per-layer launches cost about 1 / 0.8 of one whole-model launch in a
graph (docs/INTEGRATION.md, "Layer by layer"), and ``layers_per_launch`` trades that back
against how early each layer is ready.

Graphs captured apart from the transfers (vLLM's FULL graphs, captured once and replayed
after eager transfer calls): ``LayerwiseLoad(graph_waits=True)`` uses external events, so a
wait captured in the graph becomes an event-wait node that each replay binds to the latest
eager :meth:`~LayerwiseLoad.start`'s record; ``LayerwiseSave(graph_marks=True)`` records
external events in the graph (:meth:`~LayerwiseSave.mark`) that eager saves issued after a
replay wait for.

On CPU there are no streams: :meth:`LayerwiseLoad.start` records the loads and
:meth:`~LayerwiseLoad.wait` runs them, in issue order, up to the waited layer's, so a layer's
bytes appear exactly where the GPU guarantees them (a missing wait shows as wrong bytes on
the CPU too, not as a race on the GPU only); saves run when called. The calls made on the
prepared transfer are the same, in the same order, on both devices; a start refuses a bad
transfer on both before issuing anything (its checks run on the host, ahead of the queue).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Sequence

import numpy as np
import torch

from kvgroups_core import PreparedTransfer
from kvgroups_core.errors import (
    KVGroupsIndexError,
    KVGroupsTypeError,
    KVGroupsValueError,
    UnsupportedConfigError,
)
from kvgroups_core.transfer.planner import check_layers


def _first_tensor(structure: Any) -> torch.Tensor:
    if isinstance(structure, torch.Tensor):
        return structure
    if isinstance(structure, (list, tuple)):
        for item in structure:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def _grouped_layers(manager: Any) -> list[int]:
    return sorted({layer for g in manager.kernel_groups for layer in g.layer_indices})


def _select_layers(prepared: PreparedTransfer, layers: Sequence[int] | None) -> list[int]:
    """``layers`` in the caller's order (the order loads are queued), checked by the prepared
    calls' own rule (``layers=`` of ``prepared.load``)."""
    if layers is None:
        return _grouped_layers(prepared.manager)
    if isinstance(layers, Iterator):
        layers = list(layers)  # read once, for the check and the order
    check_layers(prepared.binding, layers)
    return [int(layer) for layer in layers]


def _layer_arg(layer: Any) -> int:
    """One layer index by the rule of ``layers=`` (an int or NumPy integer, not a bool)."""
    if type(layer) is int:
        return layer
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, np.integer):
        raise KVGroupsTypeError(f"layer: expected an int layer index, got {layer!r}")
    return int(layer)


def _check_positive(name: str, value: Any, *, optional: bool) -> None:
    if value is None and optional:
        return
    if type(value) is not int or value < 1:
        expected = "a positive int or None" if optional else "a positive int"
        raise KVGroupsValueError(f"{name}: expected {expected}, got {value!r}")


def _transfer_list(transfers: Any) -> Sequence[Any]:
    if not isinstance(transfers, (list, tuple)):
        raise KVGroupsTypeError(
            f"transfers: expected a list of transfer tuples, got {type(transfers).__name__}"
        )
    return transfers


def _capturing(cuda: bool) -> bool:
    return cuda and torch.cuda.is_current_stream_capturing()


def _event(external: bool) -> Any:
    """A CUDA event; ``external``: captured as an event record / wait node (PyTorch's
    ``Event(external=True)``, which older PyTorch lacks: refused with the fix)."""
    if not external:
        return torch.cuda.Event()
    try:
        return torch.cuda.Event(external=True)
    except TypeError:
        raise UnsupportedConfigError(
            "graph_waits / graph_marks: expected a PyTorch whose torch.cuda.Event takes "
            f"external=True, got {torch.__version__}"
        ) from None


def _keep_for(stream: Any, objects: Any) -> None:
    """Tell PyTorch's caching allocator that ``stream`` uses the CUDA object tensors, so a
    tensor the engine drops is not handed out again before the side stream is done with it."""
    for entry in objects:
        for t in entry if isinstance(entry, (list, tuple)) else (entry,):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                t.record_stream(stream)


class _SideStream:
    """The device, side stream and capture bookkeeping shared by loads and saves."""

    def __init__(self, prepared: Any, stream: Any, max_ctas: int | None, path: str | None) -> None:
        if not isinstance(prepared, PreparedTransfer):
            raise KVGroupsTypeError(
                "prepared: expected a PreparedTransfer (kvgroups_core.prepare(manager, "
                f"kv_caches)), got {type(prepared).__name__}"
            )
        first = _first_tensor(prepared.kv_caches)
        if first is None:
            raise KVGroupsTypeError(
                "prepared: expected a transfer prepared on torch tensors, got caches of "
                f"{type(prepared.kv_caches).__name__}"
            )
        _check_positive("max_ctas", max_ctas, optional=True)
        self.prepared = prepared
        self.device = first.device
        self.cuda = self.device.type == "cuda"
        self.max_ctas, self.path = max_ctas, path
        if not self.cuda:
            if stream is not None:
                raise KVGroupsValueError(
                    f"stream: expected None for caches on {self.device}, got {stream!r}"
                )
            self.stream = None
        else:
            self.stream = stream if stream is not None else torch.cuda.Stream(self.device)
            if self.stream.device != self.device:
                raise KVGroupsValueError(
                    f"stream: expected a stream of {self.device}, got one of {self.stream.device}"
                )
        self.issued = False  # work queued on the side stream since the last finish()
        self.issued_in_capture = False

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def check_issue(self, what: str) -> bool:
        """Whether the current stream is capturing; refuses mixing capture states in a step."""
        capturing = _capturing(self.cuda)
        if self.issued and capturing != self.issued_in_capture:
            raise UnsupportedConfigError(
                f"{what}: expected finish() between transfers queued outside and inside a "
                "CUDA graph capture, got both without it"
            )
        return capturing

    def note_issue(self, capturing: bool) -> None:
        self.issued, self.issued_in_capture = True, capturing

    def check_same_capture(self, what: str) -> None:
        """A wait on work queued in another capture state would either fail in the driver
        (an event of uncaptured work waited in a capture) or leave the graph without the
        dependency: refused with the fix."""
        if self.issued and _capturing(self.cuda) != self.issued_in_capture:
            raise UnsupportedConfigError(
                f"{what}: expected the transfers and the wait in the same CUDA graph capture "
                "(or both eager), got transfers queued "
                f"{'inside' if self.issued_in_capture else 'outside'} a capture and the wait "
                f"{'outside' if self.issued_in_capture else 'inside'} it; for a graph "
                "captured apart from the transfers use graph_waits=True / graph_marks=True"
            )


class LayerwiseLoad:
    """Every layer's load of a step issued at once; each layer's compute waits for its own.

    Parameters
    ----------
    prepared : PreparedTransfer
        ``kvgroups_core.prepare(manager, kv_caches)`` on torch tensors (CUDA or CPU).
    layers : sequence of int, optional
        The layers to load, in the order their loads are queued (default: every grouped
        layer of the manager, in index order: the forward pass's order).
    layers_per_launch : int
        Layers moved by one call (one event): 1 gives each layer its own readiness; more
        cuts launches (each one-layer call pays a launch's fixed cost) at the price of the
        first layer of each group waiting for the whole group.
    stream : torch.cuda.Stream, optional
        The side stream (default: a new one). CUDA only.
    max_ctas, path
        Passed to every ``prepared.load`` (see :func:`kvgroups_core.load`): ``max_ctas``
        leaves SMs to the forward pass.
    graph_waits : bool
        Waits will be captured in a CUDA graph that is replayed after eager :meth:`start`
        calls (vLLM's FULL graphs): the events are external, so each replay's waits bind to
        the loads of the latest :meth:`start`. :meth:`start` must then run outside any
        capture. Without it, a step captured whole (start, waits, finish inside one
        capture) turns the events into graph edges.

    Use per step: :meth:`start` (or :meth:`start_many`), :meth:`wait` before each layer's
    compute, :meth:`finish` before the forward's stream reuses what the loads touch (and, in
    a capture, before the capture ends: it joins the side stream).
    """

    def __init__(
        self,
        prepared: Any,
        *,
        layers: Sequence[int] | None = None,
        layers_per_launch: int = 1,
        stream: Any = None,
        max_ctas: int | None = None,
        path: str | None = None,
        graph_waits: bool = False,
    ) -> None:
        _check_positive("layers_per_launch", layers_per_launch, optional=False)
        self._side = side = _SideStream(prepared, stream, max_ctas, path)
        order = _select_layers(prepared, layers)
        self.layers = tuple(order)
        self._layer_list = list(order)  # layers= of start's checks
        self._steps = [
            order[i : i + layers_per_launch] for i in range(0, len(order), layers_per_launch)
        ]
        self._step_of = {layer: k for k, step in enumerate(self._steps) for layer in step}
        self.graph_waits = bool(graph_waits)
        self._pending: list[tuple[int, list]] = []  # CPU: (step, transfers) not run yet
        self._events: list = []
        if side.cuda:
            self._events = [_event(self.graph_waits) for _ in self._steps]
            if self.graph_waits:
                if _capturing(True):
                    raise UnsupportedConfigError(
                        "LayerwiseLoad(graph_waits=True): expected to be built outside a CUDA "
                        "graph capture, got a capture in progress"
                    )
                # A wait on a never-recorded event is skipped by PyTorch, so a capture before
                # the first start() would hold no wait node: record each once, on nothing.
                for event in self._events:
                    event.record(side.stream)

    @property
    def stream(self) -> Any:
        """The side stream the loads run on (None on CPU)."""
        return self._side.stream

    def start(self, objects: Any, block_ids: Any, *, skip_first_n_tokens: Any = 0) -> None:
        """Queue the load of ``objects`` into the pages of ``block_ids`` (the arguments of
        ``prepared.load``), one call per layer step, on the side stream."""
        self.start_many([(objects, block_ids, skip_first_n_tokens)])

    def start_many(self, transfers: Sequence[tuple]) -> None:
        """Several loads (``(objects, block_ids[, skip_first_n_tokens])`` each, e.g. one per
        request) queued layer by layer: every transfer's layer ``l`` before layer ``l + 1``,
        one event per layer step covering them all. Each transfer is checked whole first
        (``prepared.check_load``), so a refused one raises here, on every device, before any
        byte of any of them moves."""
        transfers = [self._transfer(t, i) for i, t in enumerate(_transfer_list(transfers))]
        if not transfers:
            return
        side = self._side
        # Once per transfer and start, on the host: one prepared call's checks, beside the
        # layer steps' calls it precedes (each of those checks again, as any call does).
        for objects, block_ids, skip in transfers:
            side.prepared.check_load(
                objects,
                block_ids,
                skip_first_n_tokens=skip,
                layers=self._layer_list,
                max_ctas=side.max_ctas,
                path=side.path,
            )
        if not side.cuda:
            self._pending.extend((k, transfers) for k in range(len(self._steps)))
            return
        capturing = side.check_issue("start")
        if self.graph_waits and capturing:
            raise UnsupportedConfigError(
                "start: expected to run outside any CUDA graph capture with graph_waits=True "
                "(the graph's waits bind to the loads of the latest eager start), got a "
                "capture in progress"
            )
        stream = side.stream
        stream.wait_stream(side.current())  # after the engine's writes queued so far
        with torch.cuda.stream(stream):
            for k, step in enumerate(self._steps):
                self._run_step(step, transfers)
                self._events[k].record(stream)
                side.note_issue(capturing)
        if not capturing:
            for objects, _, _ in transfers:
                _keep_for(stream, objects)

    def wait(self, layer: int) -> None:
        """Work queued on the current stream after this call runs once ``layer``'s load is
        done (a GPU-side wait; on CPU the pending loads up to that layer's run now)."""
        k = self._step_of.get(layer if type(layer) is int else _layer_arg(layer))
        if k is None:
            raise KVGroupsIndexError(
                f"layer: expected one of the loaded layers {list(self.layers)}, got {layer!r}"
            )
        side = self._side
        if not side.cuda:
            self._run_pending(k)
            return
        if self.graph_waits:
            if side.issued or _capturing(True):
                side.current().wait_event(self._events[k])
            return
        if not side.issued:
            return  # nothing started since the last finish()
        side.check_same_capture("wait")
        side.current().wait_event(self._events[k])

    def finish(self) -> None:
        """Every load started so far is done before work queued on the current stream after
        this call (CPU: runs what is pending). Ends the step: later waits are no-ops until
        the next :meth:`start`."""
        side = self._side
        if not side.cuda:
            self._run_pending(None)
            return
        if side.issued or (self.graph_waits and _capturing(True)):
            if not self.graph_waits:
                side.check_same_capture("finish")
            side.current().wait_event(self._events[-1])
        side.issued = False

    @property
    def pending(self) -> bool:
        """Loads started and not yet finished (:meth:`finish`)."""
        return bool(self._pending) or self._side.issued

    def _transfer(self, t: Any, i: int) -> tuple:
        if not isinstance(t, (list, tuple)) or len(t) not in (2, 3):
            raise KVGroupsTypeError(
                f"transfers[{i}]: expected (objects, block_ids[, skip_first_n_tokens]), got "
                f"{type(t).__name__}"
            )
        objects = t[0] if isinstance(t[0], (list, tuple)) else [t[0]]
        return objects, t[1], t[2] if len(t) == 3 else 0

    def _run_step(self, step: list[int], transfers: list) -> None:
        side = self._side
        for objects, block_ids, skip in transfers:
            side.prepared.load(
                objects,
                block_ids,
                skip_first_n_tokens=skip,
                layers=step,
                max_ctas=side.max_ctas,
                path=side.path,
            )

    def _run_pending(self, step: int | None) -> None:
        """Run, in issue order, everything a GPU wait for ``step``'s event covers: the
        pending loads up to that step of the latest start() holding it (None: all)."""
        pending = self._pending
        last = (
            len(pending) - 1
            if step is None
            else max((i for i, (k, _) in enumerate(pending) if k == step), default=-1)
        )
        run, self._pending = pending[: last + 1], pending[last + 1 :]
        for k, transfers in run:
            self._run_step(self._steps[k], transfers)


class LayerwiseSave:
    """Layer ``l``'s store queued as soon as layer ``l``'s KV is written, beside the rest of
    the forward pass.

    Parameters
    ----------
    prepared : PreparedTransfer
        As for :class:`LayerwiseLoad`.
    stream, max_ctas, path
        As for :class:`LayerwiseLoad`, passed to every ``prepared.store``.
    graph_marks : bool
        The forward pass is a CUDA graph captured apart from the saves: :meth:`mark` is
        called in the capture after each layer writes its KV (an external event record
        node), and :meth:`save` after a replay (eagerly) waits for that layer's mark.

    Use per step: :meth:`save` right after each layer's attention, then :meth:`finish`
    before anything overwrites those blocks or reads the objects (the forward's stream then
    waits for the saves; the host never does).
    """

    def __init__(
        self,
        prepared: Any,
        *,
        stream: Any = None,
        max_ctas: int | None = None,
        path: str | None = None,
        graph_marks: bool = False,
    ) -> None:
        self._side = side = _SideStream(prepared, stream, max_ctas, path)
        self.layers = tuple(_grouped_layers(prepared.manager))
        self.graph_marks = bool(graph_marks)
        self._marks: dict[int, Any] = {}
        if side.cuda and self.graph_marks:
            self._marks = {layer: _event(True) for layer in self.layers}
        self._marked: set[int] = set()

    @property
    def stream(self) -> Any:
        """The side stream the saves run on (None on CPU)."""
        return self._side.stream

    def mark(self, layer: int) -> None:
        """``graph_marks=True``: record that ``layer``'s KV is written, on the current stream
        (in a capture: an external event record node of the graph)."""
        layer = self._check_layer(layer)
        if not self.graph_marks:
            raise UnsupportedConfigError(
                "mark: expected a LayerwiseSave built with graph_marks=True, got one without "
                "(save() marks the layer itself)"
            )
        if self._side.cuda:
            self._marks[layer].record(self._side.current())
        self._marked.add(layer)

    def save(self, layer: int, block_ids: Any, objects: Any) -> None:
        """Queue ``prepared.store(block_ids, objects, layers=[layer])`` on the side stream,
        after the layer's KV is written (everything queued on the current stream so far, or
        the layer's :meth:`mark`)."""
        self.save_many(layer, [(block_ids, objects)])

    def save_many(self, layer: int, transfers: Sequence[tuple]) -> None:
        """Several stores (``(block_ids, objects)`` each) of one layer."""
        layer = self._check_layer(layer)
        transfers = [self._transfer(t, i) for i, t in enumerate(_transfer_list(transfers))]
        if not transfers:
            return
        side = self._side
        if len(transfers) > 1:
            # Each store checks its own arguments; with several, a bad one found after a good
            # one has filled its objects would leave a partial step: check them all first
            # (host work per transfer, the cost of one store's checks).
            for block_ids, objects in transfers:
                side.prepared.check_store(
                    block_ids, objects, layers=[layer], max_ctas=side.max_ctas, path=side.path
                )
        if not side.cuda:
            self._run(layer, transfers)
            return
        stream = side.stream
        if self.graph_marks:
            if _capturing(True):
                raise UnsupportedConfigError(
                    "save: expected to run outside any CUDA graph capture with "
                    "graph_marks=True (it waits for the graph's mark), got a capture in "
                    "progress"
                )
            if layer not in self._marked:
                raise UnsupportedConfigError(
                    f"save: expected mark({layer}) in the captured forward pass before saving "
                    f"layer {layer} with graph_marks=True, got no mark for it"
                )
        capturing = side.check_issue("save")
        if self.graph_marks:
            stream.wait_event(self._marks[layer])
        else:
            stream.wait_stream(side.current())  # the layer's KV is written by now
        with torch.cuda.stream(stream):
            self._run(layer, transfers)
        side.note_issue(capturing)
        if not capturing:
            for _, objects in transfers:
                _keep_for(stream, objects)

    def finish(self) -> None:
        """Work queued on the current stream after this call runs once every save queued so
        far is done (a GPU-side wait; a no-op on CPU, where saves ran when called)."""
        side = self._side
        if side.cuda and side.issued:
            side.check_same_capture("finish")
            side.current().wait_stream(side.stream)
        side.issued = False

    def _check_layer(self, layer: Any) -> int:
        index = _layer_arg(layer)
        if index not in self.layers:
            raise KVGroupsIndexError(
                f"layer: expected one of the manager's grouped layers {list(self.layers)}, got "
                f"{layer!r}"
            )
        return index

    def _transfer(self, t: Any, i: int) -> tuple:
        if not isinstance(t, (list, tuple)) or len(t) != 2:
            raise KVGroupsTypeError(
                f"transfers[{i}]: expected (block_ids, objects), got {type(t).__name__}"
            )
        objects = t[1] if isinstance(t[1], (list, tuple)) else [t[1]]
        return t[0], objects

    def _run(self, layer: int, transfers: list) -> None:
        side = self._side
        for block_ids, objects in transfers:
            side.prepared.store(
                block_ids, objects, layers=[layer], max_ctas=side.max_ctas, path=side.path
            )


__all__ = ["LayerwiseLoad", "LayerwiseSave"]
