"""`dynamo`: NVIDIA Dynamo's KV router cost, logit = w·prefill_blocks + decode_blocks.

prefill_blocks: blocks of the prompt the worker would compute; decode_blocks: KV blocks
it has in use. Temperature 0 takes the argmin; above 0 a worker is sampled with
probability ∝ exp(−normalised logit / temperature), from a seeded generator.
"""
from __future__ import annotations

import math
import random
from dataclasses import dataclass

from services.router.cluster import ClusterState, Request
from services.router.policies.base import StatelessFeedback
from services.router.ranking import Ranking


@dataclass(frozen=True)
class DynamoConfig:
    prefill_weight: float = 1.0
    temperature: float = 0.0
    seed: int = 0


class Dynamo(StatelessFeedback):
    name = "dynamo"

    def __init__(self, config: DynamoConfig = DynamoConfig()):
        self.config = config
        self.random = random.Random(config.seed)

    def choose(self, request: Request, cluster: ClusterState, now: float) -> Ranking | list[str]:
        logits = [self.config.prefill_weight * request.blocks_needed(w) + state.kv_blocks_used
                  + state.blocks_since_report for w, state in cluster.workers.items()]  # by slot
        ranking = cluster.ranking(logits, cluster.zeros_by_slot)
        if self.config.temperature <= 0 or len(ranking) < 2:
            return ranking
        order = list(ranking)
        logit_of = dict(zip(cluster.slot_ids, logits))
        scale = max(logits) or 1.0
        weights = [math.exp(-logit_of[w] / scale / self.config.temperature) for w in order]
        first = self.random.choices(order, weights)[0]
        return [first] + [w for w in order if w != first]
