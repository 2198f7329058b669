"""A deployment's workload in the simulator: its replicas' scheduler configuration and step times, the simulation,
and the load at which preemption starts."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.core.config import SchedulerConfig
from engine.core.metrics import RequestTiming
from planner.cost.memory_plan import (
    MemoryPlan,
)
from planner.deployment.capacity import Deployment, evaluate
from planner.deployment.speculative_plan import with_draft_cost
from planner.errors import PlannerError
from planner.simulation.simulator import BatchWait, Simulation, SimulationResult, StepTime, model_step_time
from planner.simulation.speculation import Speculation
from planner.simulation.workload import Workload


@dataclass(frozen=True)
class SimulationSetup:
    """What the simulator needs of a deployment: one replica's scheduler limits, its step time, the replicas, and
    the API server's time per request."""

    config: SchedulerConfig
    step_time: StepTime
    replicas: int
    request_overhead_s: float = 0.0
    speculation: Speculation | None = None
    receive_interval: int = 1           # decode steps between the scheduler's polls for requests
    batch_wait: BatchWait | None = None     # new prompts held back for a fuller batch (TensorRT-LLM's)

    def simulation(self, **options: Any) -> Simulation:
        """A simulation of the deployment (`Simulation`'s options: router, record_steps, progress, give_up)."""
        return Simulation(self.config, self.step_time, self.replicas, request_overhead_s=self.request_overhead_s,
                          speculation=self.speculation, receive_interval=self.receive_interval,
                          batch_wait=self.batch_wait, **options)


def simulation_setup(deployment: Deployment) -> SimulationSetup:
    result = evaluate(deployment)
    plan = result.plan
    if plan.kv_pages_per_replica <= 0:
        raise PlannerError(f"{deployment.model} leaves no room for a KV cache on {deployment.gpus} x "
                           f"{deployment.hardware} with {deployment.weights} weights")
    speculation = deployment.speculation and with_draft_cost(deployment.speculation, deployment.model)
    return SimulationSetup(scheduler_config(plan, deployment), model_step_time(result.step_seconds, result.index_topk),
                           plan.parallel.replicas, result.request_overhead_s, speculation,
                           deployment.scheduler_recv_interval, deployment.batch_wait)


def scheduler_config(plan: MemoryPlan, deployment: Deployment) -> SchedulerConfig:
    """One replica's scheduler: its KV pool from the memory plan, its limits from the deployment."""
    return SchedulerConfig(num_pages=plan.kv_pages_per_replica, page_size=plan.page_size,
                           max_num_seqs=deployment.max_num_seqs,
                           max_num_batched_tokens=deployment.max_num_batched_tokens,
                           max_model_len=plan.max_position_embeddings,
                           enable_prefix_caching=deployment.prefix_caching)


def simulate(deployment: Deployment, workload: Workload, router: str = "least-loaded", progress: bool = False,
             record_steps: bool = False,
             give_up: Callable[[RequestTiming], bool] | None = None) -> SimulationResult:
    """The workload through the deployment's replicas, each running the engine's scheduler (stopped early where
    `give_up` says the outcome is settled)."""
    return simulation_setup(deployment).simulation(router=router, record_steps=record_steps, progress=progress,
                                                   give_up=give_up).run(workload)


def preemption_onset(deployment: Deployment, workload: Workload, max_users: int) -> int:
    """The KV-limited concurrency: the most closed-loop users the KV pool serves without one preemption."""
    def preempts(users: int) -> bool:
        return simulate(deployment, replace(workload, arrival="closed", users=users)).preemptions > 0

    if not preempts(max_users):
        return max_users
    low, high = 0, max_users            # invariant: low users never preempt, high users do
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (low, middle) if preempts(middle) else (middle, high)
    return low
