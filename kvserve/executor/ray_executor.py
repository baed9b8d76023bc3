"""RayDistributedExecutor: one Ray actor per rank, in a placement group.

    engine core process (Ray driver)            Ray nodes
    ┌──────────────────────────────┐   .remote()  ┌─ RayWorkerWrapper (bundle 0) ─┐
    │ collective_rpc(method, ...)  │ ───────────► │ Worker (the same class as mp) │
    │ ray.get / ObjectRef.future() │ ◄─────────── └───────────────────────────────┘
    └──────────────────────────────┘                 ... one actor per rank
                 ranks talk to each other through torch.distributed (gloo / nccl)

Joins the cluster `RAY_ADDRESS` names (`ray start --head` elsewhere), or one this process is
already connected to, or starts a local one. Ranks are placed by a placement group with one
bundle per rank (PACK: fill a node before the next), so TP x PP ranks may span nodes; rank
and local rank (the index among this node's actors) follow vLLM. A Ray actor that dies
becomes the same WorkerDeadError as a dead worker process of the multiprocess executor.
"""
from __future__ import annotations

import logging
import os
import socket
from typing import Any, Optional

from kvserve import envs
from kvserve.config import KVServeConfig
from kvserve.executor.base import Executor
from kvserve.executor.multiproc import WorkerDeadError, WorkerRPCError

logger = logging.getLogger(__name__)



def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError('distributed_executor_backend="ray" needs Ray, which is not '
                          'installed: pip install "kvserve[ray]"') from None
    return ray


class RayWorkerWrapper:
    """The actor: holds one Worker and runs its methods by name."""

    def __init__(self) -> None:
        self.worker: Any = None

    def node_info(self) -> tuple[str, str, int]:
        import ray
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return s.getsockname()[1]

    def init_worker(self, config: KVServeConfig, local_rank: int, rank: int,
                    distributed_init_method: str) -> None:
        from kvserve.worker.worker import Worker
        self.worker = Worker(config, local_rank=local_rank, rank=rank,
                             distributed_init_method=distributed_init_method)
        self.worker.init_device()
        self.worker.load_model()

    def execute_method(self, method: str, args: tuple, kwargs: Optional[dict]) -> Any:
        return getattr(self.worker, method)(*args, **(kwargs or {}))


class RayDistributedExecutor(Executor):
    def _init_executor(self) -> None:
        ray = self._ray = _import_ray()
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._failure: Optional[str] = None
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            # RAY_ADDRESS joins that cluster; without it Ray starts a local one.
            ray.init(address=os.environ.get("RAY_ADDRESS"), ignore_reinit_error=True,
                     log_to_driver=False)
        pc = self.config.parallel_config
        self.world_size = pc.world_size
        device = "GPU" if self.config.device_config.device.startswith("cuda") else "CPU"
        self._pg = placement_group([{device: 1}] * self.world_size, strategy="PACK")
        self._remove_pg = remove_placement_group
        self.workers: list[Any] = []
        try:
            pg_timeout = float(envs.get("KVSERVE_RAY_PG_TIMEOUT_S"))
            ready, _ = ray.wait([self._pg.ready()], timeout=pg_timeout)
            if not ready:
                raise RuntimeError(
                    f"Ray could not place {self.world_size} bundles of 1 {device} within "
                    f"{pg_timeout:.0f} s (KVSERVE_RAY_PG_TIMEOUT_S): the cluster has "
                    f"{ray.cluster_resources().get(device, 0):g} {device}s.")
            actor_cls = ray.remote(num_cpus=1 if device == "CPU" else 0,
                                   num_gpus=1 if device == "GPU" else 0)(RayWorkerWrapper)
            self.workers = [actor_cls.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=rank)).remote()
                for rank in range(self.world_size)]
            self._init_workers()
        except BaseException:
            self.shutdown()
            raise

    def _init_workers(self) -> None:
        ray = self._ray
        infos = ray.get([w.node_info.remote() for w in self.workers])
        self.worker_node_ids = [node for node, _, _ in infos]
        self.worker_pids = [pid for _, _, pid in infos]
        # Local rank: the index among the actors on the same node (the device it uses there).
        seen: dict[str, int] = {}
        local_ranks = []
        for node in self.worker_node_ids:
            local_ranks.append(seen.get(node, 0))
            seen[node] = local_ranks[-1] + 1
        ip, port = infos[0][1], ray.get(self.workers[0].free_port.remote())
        init_method = f"tcp://{ip}:{port}"
        self._get([w.init_worker.remote(self.config, local_ranks[rank], rank, init_method)
                   for rank, w in enumerate(self.workers)], "init_worker")

    # ------------------------------------------------------------------ RPC
    def collective_rpc(self, method: str, args: tuple = (), kwargs: Optional[dict] = None,
                       unique_reply_rank: Optional[int] = None, non_block: bool = False,
                       timeout: Optional[float] = None) -> Any:
        if self._failure is not None:
            raise WorkerDeadError(self._failure)
        refs = [w.execute_method.remote(method, args, kwargs) for w in self.workers]
        if non_block:
            assert unique_reply_rank is not None
            return _RayFuture(self, refs, unique_reply_rank, method)
        results = self._get(refs, method, timeout)
        return results if unique_reply_rank is None else [results[unique_reply_rank]]

    def _get(self, refs: list[Any], method: str, timeout: Optional[float] = None) -> list[Any]:
        ray = self._ray
        try:
            return ray.get(refs, timeout=timeout)
        except ray.exceptions.RayActorError:
            raise self._dead_error(refs) from None
        except ray.exceptions.RayTaskError as e:
            # A collective that failed because a peer died: report the death.
            self._raise_if_dead(refs)
            raise WorkerRPCError(f"Ray worker failed in {method!r}:\n{e}") from None

    def _raise_if_dead(self, refs: list[Any]) -> None:
        ray = self._ray
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=2.0)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                raise self._dead_error(refs) from None
            except ray.exceptions.RayTaskError:
                pass

    def _dead_error(self, refs: list[Any]) -> WorkerDeadError:
        ray = self._ray
        dead = []
        for rank, ref in enumerate(refs):
            ready, _ = ray.wait([ref], timeout=0.5)
            if ready:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError:
                    dead.append(rank)
                except Exception:
                    pass
        who = ", ".join(f"rank {r} (pid {self.worker_pids[r]})" for r in dead) or "a rank"
        self._failure = (f"Ray worker actor of {who} died; the executor has stopped and the "
                         f"remaining actors were ended.")
        logger.error(self._failure)
        for w in self.workers:
            ray.kill(w, no_restart=True)
        return WorkerDeadError(self._failure)

    def execute_model(self, scheduler_output: Any, non_block: bool = False) -> Any:
        reply = self.collective_rpc("execute_model", (scheduler_output,),
                                    unique_reply_rank=self.output_rank, non_block=non_block)
        return reply if non_block else reply[0]

    def check_health(self) -> None:
        self.collective_rpc("check_health", timeout=60.0)

    def shutdown(self) -> None:
        ray = getattr(self, "_ray", None)
        if ray is None or not ray.is_initialized():
            return
        for w in getattr(self, "workers", []):
            ray.kill(w, no_restart=True)
        self.workers = []
        if getattr(self, "_pg", None) is not None:
            try:
                self._remove_pg(self._pg)
            except Exception:
                pass
            self._pg = None
        if self._started_ray and not os.environ.get("RAY_ADDRESS"):
            ray.shutdown()


class _RayFuture:
    """The output rank's reply of a non-blocking execute_model (the batch queue)."""

    def __init__(self, executor: RayDistributedExecutor, refs: list[Any], rank: int,
                 method: str) -> None:
        self._executor, self._refs, self._rank, self._method = executor, refs, rank, method

    def done(self) -> bool:
        ready, _ = self._executor._ray.wait([self._refs[self._rank]], timeout=0)
        return bool(ready)

    def result(self, timeout: Optional[float] = None) -> Any:
        return self._executor._get(self._refs, self._method, timeout)[self._rank]
