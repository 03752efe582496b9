"""Evaluation: workloads, metrics, the simulator, the profiler and the planner (svc sim/bench/profile/plan)."""
