"""SGLang's EPLB recovery driven on the CPU, every surviving rank at once: its own entry point
(``eplb_manager.update_expert_location_with_recovery``), its own ``ExpertLocationUpdater``, its own
expert-location tables, over real ``FusedMoE`` modules (``sglang_harness``).

Only what a process and its transport give is stood in for: each rank runs in a thread of its own
whose process-level expert-location table is its own (:class:`PerRank`), ``torch.distributed``'s
world size and ``batch_isend_irecv`` move tensors between the threads in order (:class:`Fabric`),
and SGLang's elastic-EP state marks the failed ranks inactive.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import queue
import threading
import types
from typing import Any, Callable, Iterator, Sequence
from unittest import mock

import sglang_harness as h
import torch
from sglang.srt.eplb import expert_location
from sglang.srt.models import deepseek_v2
from sglang.srt.utils.common import LazyValue
from torch import nn

from megamoe_convert.output import marker

EP_SIZE, REDUNDANT = 4, 4
#: Rank 3 holds the only copies of experts 6 and 7 in both layers.
OLD = [[0, 1, 2, 3, 4, 5, 0, 1, 2, 6, 7, 3], [0, 1, 2, 3, 4, 5, 2, 0, 1, 6, 7, 4]]
#: After rank 3 failed: 6 and 7 go to ranks 0-1 (from nowhere), rank 2 takes 5 / 4 from rank 1 and
#: moves its own experts between slots; rank 3's row is what it was (it runs no more).
NEW = [[0, 1, 6, 3, 4, 7, 5, 2, 0, 1, 2, 3], [7, 1, 2, 3, 6, 5, 2, 0, 4, 6, 7, 4]]
FAILED = 3
SURVIVORS = [r for r in range(EP_SIZE) if r != FAILED]
#: By rank, layer and slot: what the new placement gives a rank that no live rank held.
LOST_SLOTS = {0: {0: [2], 1: [0]}, 1: {0: [2], 1: [1]}, 2: {}}


def table_args(table: Sequence[Sequence[int]]) -> dict[str, str]:
    return {"init_expert_location": json.dumps({"physical_to_logical_map": [list(r) for r in table]})}


def metadata(config: types.SimpleNamespace, table: Sequence[Sequence[int]], rank: int) -> Any:
    """SGLang's own expert-location table for ``rank`` from a placement (as ``init_by_mapping`` makes it)."""
    model_config = types.SimpleNamespace(hf_config=config)
    for_model = staticmethod(lambda m: h.DeepseekV4ForCausalLM.get_model_config_for_expert_location(m.hf_config))
    with mock.patch.object(expert_location.ModelConfigForExpertLocation, "from_model_config", for_model):
        return expert_location.ExpertLocationMetadata.init_by_mapping(model_config, torch.tensor(table),
                                                                      moe_ep_rank=rank)


def with_routed_weights(model: nn.Module) -> nn.Module:
    """What ``DeepseekV4ForCausalLM.__init__`` sets up for EPLB: each MoE layer's expert tensors, as
    ``DeepseekV2MoE.get_moe_weights`` (SGLang's own) lists them."""
    def weights() -> dict[int, list[torch.Tensor]]:
        return {i: deepseek_v2.DeepseekV2MoE.get_moe_weights(types.SimpleNamespace(experts=layer.mlp.experts,
                                                                                   num_fused_shared_experts=0))
                for i, layer in enumerate(model.model.layers)}
    model._routed_experts_weights_of_layer = LazyValue(weights)
    return model


def served_from(model: nn.Module, path: object) -> nn.Module:
    """The config section SGLang's hooked ``get_config`` leaves on a model served from ``path``."""
    setattr(model.config, marker.SECTION, {"converted_by": marker.TOOL, "path": str(path)})
    return model


@dataclasses.dataclass
class Op:
    """``torch.distributed.P2POp`` without a process group (the threads have none)."""

    op: Any
    tensor: torch.Tensor
    peer: int


class Fabric:
    """``batch_isend_irecv`` between threads: a send is queued at once (what it sends is the sender's
    bytes at that moment), a receive waits for the next tensor from its peer; FIFO per pair, as NCCL
    matches them."""

    def __init__(self) -> None:
        self.rank = threading.local()
        self.queues: dict[tuple[int, int], queue.Queue[torch.Tensor]] = {}
        self.lock = threading.Lock()
        self.sent: list[tuple[int, int, int]] = []

    def _queue(self, src: int, dst: int) -> queue.Queue[torch.Tensor]:
        with self.lock:
            return self.queues.setdefault((src, dst), queue.Queue())

    def batch_isend_irecv(self, ops: list[Any]) -> list[Any]:
        me, waits = self.rank.value, []
        for op in ops:
            if op.op is torch.distributed.isend:
                self._queue(me, op.peer).put(op.tensor.clone())
                self.sent.append((me, op.peer, op.tensor.nbytes))
            else:
                source, target = self._queue(op.peer, me), op.tensor
                waits.append(types.SimpleNamespace(wait=lambda s=source, t=target: t.copy_(s.get(timeout=60))))
        return waits


class PerRank:
    """The process-level expert-location table, each rank's own (each thread is a rank's process)."""

    def __init__(self) -> None:
        self.local = threading.local()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local.value, name)


@contextlib.contextmanager
def ranks_at_once(failed: int = FAILED) -> Iterator[tuple[Fabric, PerRank]]:
    """Transport, world size, per-rank tables and the elastic-EP state with ``failed`` inactive."""
    from sglang.srt.elastic_ep.elastic_ep import ElasticEPState, ElasticEPStateManager
    from sglang.srt.eplb import expert_location_updater

    active = torch.ones(EP_SIZE, dtype=torch.int32)
    active[failed] = 0
    state = ElasticEPState(active_ranks=active, last_active_ranks=active.clone(), active_ranks_cpu=active.clone(),
                           effective_ep_size=EP_SIZE, original_ep_size=EP_SIZE)
    fabric, tables = Fabric(), PerRank()
    with h.patched(0, EP_SIZE, REDUNDANT), \
            mock.patch.object(ElasticEPStateManager, "_instance", state), \
            mock.patch.object(torch.distributed, "batch_isend_irecv", fabric.batch_isend_irecv), \
            mock.patch.object(expert_location_updater, "P2POp", Op), \
            mock.patch.object(torch.distributed, "get_world_size", lambda *a, **k: EP_SIZE), \
            mock.patch.object(torch.cpu, "empty_cache", lambda: None, create=True):  # a GPU's allocator
        expert_location.set_global_expert_location_metadata(tables, allow_overwrite=True)
        yield fabric, tables


def recover(models: dict[int, nn.Module], config: types.SimpleNamespace, entry: Callable[..., Any],
            ) -> dict[int, list[tuple[str, Any]]]:
    """SGLang's recovery entry point ``entry`` on every surviving rank at once, from ``OLD`` to ``NEW``;
    returns by rank the reloads SGLang asked for (its checkpoint reload callable), or the error it raised."""
    from sglang.srt.eplb.expert_location_updater import ExpertLocationUpdater

    asked: dict[int, list[tuple[str, Any]]] = {r: [] for r in models}
    with ranks_at_once() as (fabric, tables):
        old = {rank: metadata(config, OLD, rank) for rank in models}
        new = {rank: metadata(config, NEW, rank) for rank in models}

        def run(rank: int) -> None:
            fabric.rank.value = rank
            tables.local.value = old[rank]
            try:
                entry(expert_location_updater=ExpertLocationUpdater(), model=models[rank],
                      new_expert_location_metadata=new[rank], update_layer_ids=[0, 1],
                      tp_rank=rank, expert_backup_client=None,
                      update_weights_from_disk_callable=lambda *a, **k: asked[rank].append(("disk", k)),
                      ep_dispatch_algorithm="static", init_lplb_solvers_callable=lambda: None)
            except Exception as e:  # noqa: BLE001 - reported to the test
                asked[rank].append(("error", e))

        threads = [threading.Thread(target=run, args=(r,)) for r in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    return asked


def refusal(model: nn.Module, config: types.SimpleNamespace, entry: Callable[..., Any]) -> tuple[Exception, bool]:
    """Rank 0's recovery through ``entry``, which must refuse: the one error it raised (an
    ``InstallError`` of one line), and whether every kernel tensor of the model's experts is as it was."""
    from megamoe_convert.errors import InstallError

    before = {p: [t.clone() for t in h.state(m).values()] for p, m in h.experts_of(model).items()}
    asked = recover({0: model}, config, entry)
    [(kind, error)] = asked[0]
    assert kind == "error" and isinstance(error, InstallError), asked
    assert "\n" not in str(error)
    return error, all(torch.equal(a, b) for prefix, module in h.experts_of(model).items()
                      for a, b in zip(h.state(module).values(), before[prefix], strict=True))


def fresh_build(ckpt: Any, config: types.SimpleNamespace, rank: int, table: Sequence[Sequence[int]]) -> nn.Module:
    """SGLang's own loading of the checkpoint for ``rank`` under ``table``: the reference (built from the
    config without the section a served model's carries, so the plugin's hooked load installs nothing)."""
    own = types.SimpleNamespace(**{k: v for k, v in vars(config).items() if k != marker.SECTION})
    with h.patched(rank, EP_SIZE, REDUNDANT, **table_args(table)):
        model = h.build_main_model(own, rank, REDUNDANT)
        h.sglang_load(model, ckpt)
    return model
