"""Progress from a training script that imports nothing from Resurgo.

The node agent puts ``agent/bootstrap/`` first on its ranks' ``PYTHONPATH``
(:mod:`agent.node.launch`); Python then imports its ``sitecustomize`` in every
rank, which calls :func:`install` and then runs the ``sitecustomize`` the rank
would have imported without it (a distribution's or the user's). Nothing of
torch is imported early: :func:`install` adds a meta-path finder that waits
for ``import torch`` to finish, and then

- registers a global optimizer-step post hook
  (``torch.optim.optimizer.register_optimizer_step_post_hook``): each step of
  the first optimizer that steps is a beat of the next step, in phase train;
- wraps ``torch.Tensor.backward`` (and ``GradScaler.scale``): the scalar a
  backward pass starts from is the step's loss (:mod:`agent.train.losstap`,
  read without a device synchronization), sent as a step report that feeds
  the supervisor's training-health watch (a NaN, a spike);
- wraps ``torch.save``: the write is phase checkpoint (its grace covers a long
  write), and a file written under the job's checkpoint root
  (``RESURGO_CKPT_ROOT``) is noted to the agent (``checkpoint_written``:
  ``resurgo status`` shows it); ``torch.load``: a checkpoint dict with an integer under one of
  the step keys (nanoGPT's ``iter_num``, ``step``, ``global_step``, ...)
  says where the script resumes, so the count goes on from there;
- wraps ``torch.nn.Module.train``: a model put in eval mode is phase eval;
- wraps the data loader's ``__next__`` (``_BaseDataLoaderIter``): a wait for
  the next batch that lasts over :data:`DATA_WAIT_S` is phase data
  (:class:`DataWait`), so a stalled loader (a slow file system, a restarting
  worker) is no hang of the rank, and its peers waiting for it in a
  collective are held (:mod:`supervisor.core.hang_hold`);
- when the script imports ``torch.distributed.checkpoint`` (DCP; never
  imported here first: it costs seconds), wraps its ``save`` and
  ``async_save`` (phase checkpoint while the call blocks) and ``load``. A save
  into a directory under the checkpoint root is noted by the coordinator
  (rank 0 of the save's group) once it is complete (for ``async_save``, when
  its upload finishes), with the step the state dict names (the step keys)
  or the directory's name names (torchtitan's ``step-120``); a ``dcp.load``
  that fills in such a step key continues the count, as ``torch.load`` does.

These beats carry the automatic flag: the agent reports such a rank as hung
only when a native-aware stack confirms that a local rank waits in a
collective (:mod:`agent.node.watch`). A script that makes a
:class:`~agent.train.heartbeat.Heartbeat` of its own (our library) is
instrumented: the hooks stand down, nothing is counted twice. Nothing here
raises into the script or blocks it; a step costs one hook call and one
non-blocking send (``bench/agent.py`` measures it). Opt out with
``RESURGO_AUTO_PROGRESS=0`` in the job's environment.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any

from agent.checkpoint.layouts import step_in_path
from agent.checkpoint.layouts.torchfile import step_named
from agent.train import heartbeat as heartbeat_module
from agent.train.heartbeat import Heartbeat
from agent.train.losstap import LossTap, mark_scaled
from agent.wire.datagram import Phase
from agent.wire.environ import ENV_AGENT_SOCKET, ENV_CKPT_ROOT, ENV_RANK

ENV_AUTO_PROGRESS = "RESURGO_AUTO_PROGRESS"
OFF = frozenset({"0", "no", "off", "false"})
DCP_MODULE = "torch.distributed.checkpoint"
DCP_STATE_DICT_MODULE = "torch.distributed.checkpoint.state_dict"
# Never an object's id(): steps of any optimizer are not counted while it is set.
_NO_OPTIMIZER = 0
# A wait for the data loader's next batch longer than this is phase data.
DATA_WAIT_S = 1.0


def enabled(environ: dict[str, str] | os._Environ[str]) -> bool:
    """Whether this process is a rank under an agent that has not opted out."""
    return (
        bool(environ.get(ENV_AGENT_SOCKET))
        and ENV_RANK in environ
        and environ.get(ENV_AUTO_PROGRESS, "1").strip().lower() not in OFF
    )


class DataWait:
    """Phase data while the training thread waits long for its next batch.

    The wrapped ``__next__`` notes when a wait began and when it ended (a lock
    taken once, no message); a daemon thread, started at the first wait, beats
    phase data once a wait passes ``after_s``, and the wait's end beats the
    phase before it again. A short wait, the usual one with workers that
    prefetch, sends nothing. The lock orders the two threads' beats: the
    phase of the last one is never data once the wait ended.
    """

    def __init__(
        self,
        beats: Heartbeat,
        after_s: float = DATA_WAIT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._beats = beats
        self._after_s = after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._since: float | None = None
        self._step = 0
        self._back: Phase | None = None  # the phase to beat again once the wait ends
        self._thread: threading.Thread | None = None
        # A process forked from the rank (a data loader worker) gets neither the
        # watch thread nor, held by it at the fork, the lock: it starts afresh.
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()
        self._since, self._back, self._thread = None, None, None

    def began(self, step: int) -> None:
        """The training thread asks for a batch at ``step``."""
        self._step = step
        self._since = self._clock()
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._watch, name="resurgo-data-wait", daemon=True
            )
            self._thread.start()

    def ended(self) -> None:
        """The batch came (or the loader raised)."""
        with self._lock:
            self._since = None
            back, self._back = self._back, None
        if back is not None:
            self._beats.beat(self._step, back)

    def check(self) -> bool:
        """Beat phase data when the current wait passed ``after_s``; whether it did."""
        with self._lock:
            since = self._since
            if since is None or self._back is not None or self._clock() - since < self._after_s:
                return False
            self._back = self._beats.current_phase
            self._beats.beat(self._step, Phase.DATA)
            return True

    def _watch(self) -> None:
        while True:
            time.sleep(self._after_s / 2)
            with contextlib.suppress(Exception):
                self.check()


class AutoProgress:
    """The hooks' state: the step count, the first optimizer, the heartbeat."""

    def __init__(self, beats: Heartbeat) -> None:
        self.beats = beats
        self.step = 0
        self.data = DataWait(beats)
        self.losses = LossTap()
        self._optimizer: int | None = None
        self._handle: Any = None
        # The thread that trains (of the first counted step) and whether it is in a save.
        self._trainer = threading.main_thread().ident
        self._saving = False
        root = os.environ.get(ENV_CKPT_ROOT)
        self._root = os.path.join(os.path.abspath(root), "") if root else None

    @property
    def standing_down(self) -> bool:
        return heartbeat_module.instrumented

    def after_step(self, optimizer: object, args: object, kwargs: object) -> None:
        """The optimizer-step post hook: one beat per step of the first optimizer."""
        try:
            if heartbeat_module.instrumented:
                if self._handle is not None:
                    self._handle.remove()
                    self._handle = None
                return
            if self._optimizer is None:
                self._optimizer = id(optimizer)
                self._trainer = threading.get_ident()
            elif id(optimizer) != self._optimizer:
                return
            self.step += 1
            told = False
            for step, loss in self.losses.step_ended(self.step):
                self.beats.report_step(step, loss=loss)  # a beat of ``step`` too
                told = step == self.step
            if not told:
                self.beats.beat(self.step)
        except Exception:  # never into the user's training loop
            pass

    def resumed_at(self, loaded: object, source: object = None) -> None:
        """A loaded checkpoint that names its step: the count goes on from it.

        The step is the one the loaded dict names, else the one its checkpoint
        directory's name gives (Hugging Face's Trainer loads
        ``checkpoint-40/optimizer.pt``, its step kept in a JSON file).
        """
        try:
            if self.standing_down:
                return
            step = step_named(loaded)
            if step is None and isinstance(source, str | os.PathLike):
                step = self._checkpoint_of(os.path.abspath(os.fspath(source)))[1]
            if step is not None:
                self.step = step
                self.losses.forget()
                self.beats.beat(step)
        except Exception:
            pass

    def _checkpoint_of(self, path: str) -> tuple[str, int | None]:
        """The checkpoint a file under the root belongs to, and its step when its name
        gives one: ``checkpoint-60/rng_state.pth`` is checkpoint-60 of step 60,
        ``global_step60/...`` step 60 (DeepSpeed); a file in the root is its own."""
        if self._root is None or not path.startswith(self._root):
            return path, None
        top = os.path.join(self._root, path[len(self._root) :].split(os.sep)[0])
        step = step_in_path(top) if top != path else None
        return (top, step) if step is not None else (path, None)

    def wrap_save(self, save: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(save)
        def saving(*args: Any, **kwargs: Any) -> Any:
            if self.standing_down:
                return save(*args, **kwargs)
            with self.checkpointing():
                result = save(*args, **kwargs)
            self.saved(args[1] if len(args) > 1 else kwargs.get("f"))
            return result

        return saving

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        """Phase checkpoint around a save the training loop waits for: on the training
        thread, outermost only. DCP writes its non-tensor items with ``torch.save``, and
        ``async_save`` writes on a thread of its own while training goes on."""
        if self._saving or threading.get_ident() != self._trainer:
            yield
            return
        self._saving = True
        try:
            with self.beats.phase(Phase.CHECKPOINT):
                yield
        finally:
            self._saving = False

    def saved(self, target: object) -> None:
        """Note a file the script saved under the job's checkpoint root (any file when
        the root is unknown); file objects and other paths are not checkpoints."""
        try:
            if not isinstance(target, str | os.PathLike):
                return
            path = _final_name(os.path.abspath(os.fspath(target)))
            if self._under_root(path):
                checkpoint, step = self._checkpoint_of(path)
                self.beats.file_written(checkpoint, step)
        except Exception:
            pass

    def _under_root(self, path: str) -> bool:
        """Whether ``path`` lies under the checkpoint root (anything does when it is unknown)."""
        return self._root is None or os.path.join(path, "").startswith(self._root)

    def wrap_dcp_save(self, save: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(save)
        def saving(*args: Any, **kwargs: Any) -> Any:
            if self.standing_down:
                return save(*args, **kwargs)
            with self.checkpointing():
                result = save(*args, **kwargs)
            note = self.dcp_note(args, kwargs)
            if note is not None:
                self.beats.file_written(*note)
            return result

        return saving

    def wrap_dcp_async_save(self, async_save: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(async_save)
        def saving(*args: Any, **kwargs: Any) -> Any:
            if self.standing_down:
                return async_save(*args, **kwargs)
            # Phase checkpoint covers the staging the call blocks on; the upload
            # runs behind the next steps, which beat as usual.
            with self.checkpointing():
                result = async_save(*args, **kwargs)
            note = self.dcp_note(args, kwargs)  # the step as staged, not as it is later
            if note is not None:
                with contextlib.suppress(Exception):
                    # A Future, or (with an async_stager) an AsyncSaveResponse.
                    upload = getattr(result, "upload_completion", result)
                    upload.add_done_callback(lambda done: self._uploaded(done, note))
            return result

        return saving

    def _uploaded(self, done: Any, note: tuple[str, int]) -> None:
        """The upload future's callback (DCP's writer thread): a failed save is no checkpoint."""
        with contextlib.suppress(Exception):
            if not done.cancelled() and done.exception() is None:
                self.beats.file_written(*note)

    def dcp_note(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[str, int] | None:
        """What to note of a DCP save called with ``args``/``kwargs``: its directory and step,
        or None when it is not this rank's to note (not the coordinator, not under the root,
        not a local directory). Looks at the call only: no I/O, no collective."""
        try:
            target = kwargs.get("checkpoint_id")
            if target is None:  # FileSystemWriter(path) keeps it as .path
                target = getattr(kwargs.get("storage_writer"), "path", None)
            if not isinstance(target, str | os.PathLike) or "://" in os.fspath(target):
                return None
            path = os.path.abspath(os.fspath(target))
            if not self._under_root(path) or not _coordinates(kwargs):
                return None
            step = step_named(args[0] if args else kwargs.get("state_dict"))
            if step is None:
                step = step_in_path(path)
            return path, self.step if step is None else step
        except Exception:
            return None

    def wrap_dcp_load(self, load: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(load)
        def loading(*args: Any, **kwargs: Any) -> Any:
            result = load(*args, **kwargs)
            # DCP loads in place: a step key the script left as a placeholder now
            # holds the saved step.
            self.resumed_at(args[0] if args else kwargs.get("state_dict"))
            return result

        return loading

    def wrap_init_optim_state(self, init: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(init)
        def initializing(*args: Any, **kwargs: Any) -> Any:
            # get_state_dict creates a fresh optimizer's state with one step at lr 0
            # and zero grads: not a training step. Costs the step hook nothing.
            first, self._optimizer = self._optimizer, _NO_OPTIMIZER
            try:
                return init(*args, **kwargs)
            finally:
                self._optimizer = first

        return initializing

    def attach_dcp_state_dict(self, state_dict: ModuleType) -> None:
        """Hook into ``torch.distributed.checkpoint.state_dict`` (``get_state_dict``)."""
        name = "_init_optim_state"
        with contextlib.suppress(Exception):
            setattr(state_dict, name, self.wrap_init_optim_state(getattr(state_dict, name)))

    def attach_dcp(self, dcp: ModuleType) -> None:
        """Hook into an imported ``torch.distributed.checkpoint``: its package-level names
        only, which scripts call; ``async_save`` calls the defining module's ``save``
        itself, and that one must stay unwrapped (no second phase, no second note)."""
        for name, wrap in (
            ("save", self.wrap_dcp_save),
            ("async_save", self.wrap_dcp_async_save),
            ("load", self.wrap_dcp_load),
        ):
            with contextlib.suppress(Exception):
                setattr(dcp, name, wrap(getattr(dcp, name)))
        _after_import(DCP_STATE_DICT_MODULE, self.attach_dcp_state_dict)

    def wrap_load(self, load: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(load)
        def loading(*args: Any, **kwargs: Any) -> Any:
            loaded = load(*args, **kwargs)
            self.resumed_at(loaded, args[0] if args else kwargs.get("f"))
            return loaded

        return loading

    def wrap_backward(self, backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def backwarding(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.standing_down:
                self.losses.started_backward(tensor)
            return backward(tensor, *args, **kwargs)

        return backwarding

    @staticmethod
    def wrap_scale(scale: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(scale)
        def scaling(scaler: Any, outputs: Any) -> Any:
            return mark_scaled(scale(scaler, outputs), getattr(scaler, "_scale", None))

        return scaling

    def wrap_train(self, train: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(train)
        def training(module: Any, mode: bool = True) -> Any:
            result = train(module, mode)
            try:
                phase = Phase.TRAIN if mode else Phase.EVAL
                if not self.standing_down and self.step > 0 and self.beats._phase is not phase:
                    self.beats.beat(self.step, phase)
            except Exception:
                pass
            return result

        return training

    def wrap_next(self, next_batch: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(next_batch)
        def next_batching(iterator: Any) -> Any:
            # Before the first step the phase is init, whose grace covers loading.
            if self.step == 0 or self.standing_down or threading.get_ident() != self._trainer:
                return next_batch(iterator)
            self.data.began(self.step)
            try:
                return next_batch(iterator)
            finally:
                self.data.ended()

        return next_batching

    def attach(self, torch: Any) -> None:
        """Hook into an imported torch; a part that fails leaves that part as it was."""
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self._handle = register_optimizer_step_post_hook(self.after_step)
        except Exception:
            return  # no step signal: the agent's stack sampling still watches the rank
        for owner, name, wrap in (
            (torch, "save", self.wrap_save),
            (torch, "load", self.wrap_load),
            (torch.nn.Module, "train", self.wrap_train),
            (torch.Tensor, "backward", self.wrap_backward),
        ):
            with contextlib.suppress(Exception):
                setattr(owner, name, wrap(getattr(owner, name)))
        with contextlib.suppress(Exception):
            scaler = torch.amp.grad_scaler.GradScaler
            scaler.scale = self.wrap_scale(scaler.scale)
        with contextlib.suppress(Exception):
            loader_iter = torch.utils.data.dataloader._BaseDataLoaderIter
            loader_iter.__next__ = self.wrap_next(loader_iter.__next__)
        _after_import(DCP_MODULE, self.attach_dcp)


def _after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    """Call ``then`` on module ``name`` now if it is imported, else once it is."""
    if name in sys.modules:
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def _coordinates(kwargs: dict[str, Any]) -> bool:
    """Whether this rank is the coordinator of the DCP save called with ``kwargs`` (rank 0
    of its process group; every process when it saves alone)."""
    dist = sys.modules.get("torch.distributed")
    if kwargs.get("no_dist") or dist is None:
        return True
    if not dist.is_available() or not dist.is_initialized():
        return True
    return bool(dist.get_rank(kwargs.get("process_group")) == 0)


# Written under a temporary name, then renamed (the atomic-save pattern): the
# note names the file it becomes.
_TEMP_SUFFIXES = (".tmp", ".temp", ".part", ".partial")


def _final_name(path: str) -> str:
    for suffix in _TEMP_SUFFIXES:
        if path.endswith(suffix) and len(path) > len(suffix):
            return path[: -len(suffix)]
    return path


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds nothing itself; lets ``name``'s loader run, then calls ``then`` on the module."""

    def __init__(self, name: str, then: Callable[[ModuleType], None]) -> None:
        self._name = name
        self._then = then

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self._name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _ThenLoader(spec.loader, self._then)
        return spec


class _ThenLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader, then: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._then = then

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with contextlib.suppress(Exception):  # the script's import succeeds whatever happens
            self._then(module)


_installed: AutoProgress | None = None


def install(environ: dict[str, str] | os._Environ[str] | None = None) -> AutoProgress | None:
    """Arm the hooks for this rank (see the module docstring); None when not a supervised rank."""
    global _installed
    env = os.environ if environ is None else environ
    if _installed is not None or not enabled(env):
        return _installed
    progress = AutoProgress(Heartbeat.from_env(env, automatic=True))
    _after_import("torch", progress.attach)
    _installed = progress
    return progress
