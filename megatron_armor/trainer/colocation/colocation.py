"""Who owns the GPU when: the trainer's phases beside colocated rollout servers.

Colocated, the trainer and the servers take turns on each GPU: a `MemoryHandoff` has the servers
release their memory for each training phase, a `TrainerOffload` parks the trainer's own state for the
rollout phase. Without either, every method here is a no-op (the context managers yield at once), so
the RL step calls them unconditionally and every move of GPU memory is one line of it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from megatron_armor.rollout.weight_sync import SyncReport
from megatron_armor.trainer.colocation.memory_handoff import MemoryHandoff
from megatron_armor.trainer.colocation.offload import TrainerOffload

PushActor = Callable[[], SyncReport]  # collective: push the actor's weights into its engine


class Colocation:
    """The GPU phases of one trainer rank: the servers' memory hand-off and the trainer's offload.

    Every method is collective (every rank calls it in the same order): the hand-off releases and resumes
    the servers between barriers.
    """

    def __init__(self, memory_handoff: MemoryHandoff | None = None, offload: TrainerOffload | None = None) -> None:
        self.memory_handoff, self.offload = memory_handoff, offload

    @property
    def offloaded(self) -> bool:
        """The trainer parks its state between its phases (rollout.memory.offload_trainer)."""
        return self.offload is not None

    @contextlib.contextmanager
    def trainer_phase(self, *, resume_serving: bool = True) -> Iterator[None]:
        """The trainer owns the GPU inside (logprobs, the update, a rollback, a checkpoint save).

        The servers release their memory (`memory_handoff`) before the trainer's state comes back
        (`offload`); after the block all of it but the actor's weights, which the push and the gate
        that follow read, leaves again before the servers take their memory back: all of it, or with
        `resume_serving` False their weights' memory only (`push_actor_and_serve` follows).
        """
        handoff = (self.memory_handoff.training_phase(resume_serving=resume_serving) if self.memory_handoff
                   else contextlib.nullcontext())
        with handoff, (self.offload.training_phase() if self.offload else contextlib.nullcontext()):
            yield

    def push_actor_and_serve(self, push_actor: PushActor, *, keep_weights: bool = False) -> SyncReport:
        """After `trainer_phase(resume_serving=False)`: push the actor's weights into servers that have their
        weights' memory back (their old values are lost without --enable-weights-cpu-backup), park the
        trainer's copy (unless `keep_weights`: the MIPU gate scores with it), then give the servers their
        KV cache and CUDA graphs back: this push never shares the GPU with a KV cache."""
        try:
            report = push_actor()
            if not keep_weights:
                self.park_for_rollouts()
        except BaseException:
            if self.memory_handoff is not None:
                self.memory_handoff.recover()
            raise
        if self.memory_handoff is not None:
            self.memory_handoff.resume_serving()
        return report

    def park_for_rollouts(self) -> None:
        """Offloaded: nothing of the trainer on the GPU (a rollout phase starts; also after start-up)."""
        if self.offload is not None:
            self.offload.park()

    @contextlib.contextmanager
    def state_resident(self, push_actor: PushActor) -> Iterator[None]:
        """All of the trainer's state readable inside (a checkpoint save, the subspace capture).

        Offloaded, that takes a trainer phase (the servers' memory for the optimizer state), after which
        servers that released their memory get the actor's weights pushed again (`push_actor`), which the
        release lost (a shared engine then holds the actor's); not offloaded, the state is always there.
        """
        if self.offload is None:
            yield
            return
        with self.trainer_phase(resume_serving=False):
            yield
        if self.memory_handoff is not None:
            self.push_actor_and_serve(push_actor)

    def state_writable(self) -> contextlib.AbstractContextManager:
        """All of the trainer's state on the GPU to be overwritten inside (a resume). Offloaded, in a trainer
        phase whose servers come back without weights: the start-up pushes that follow a resume refill them."""
        return self.trainer_phase() if self.offload is not None else contextlib.nullcontext()

    def weights_resident(self, *models: str) -> contextlib.AbstractContextManager:
        """The named policies' weights (by `Policy.name`) on the GPU inside the block (a push, a reference reset),
        parked after if they were."""
        return self.offload.weights_resident(*models) if self.offload else contextlib.nullcontext()

    def handoff_metrics(self) -> dict[str, float]:
        """What the servers' hand-offs since the last trainer phase took (read right after the weight push)."""
        return {"perf/memory_handoff_seconds": self.memory_handoff.seconds} if self.memory_handoff else {}

    def offload_metrics(self) -> dict[str, float]:
        """The offload's park/restore time since the last call and what it parks (`TrainerOffload.metrics`)."""
        return self.offload.metrics() if self.offload is not None else {}
