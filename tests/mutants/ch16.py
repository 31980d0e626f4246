"""Wrong answers to problem set 16 that its checks must reject: each named (or documented) for its mistake."""

import dataclasses

import torch
from torch import nn

from miniinfer.course import checks as testing
from miniinfer.distributed.pipeline import split_layers
from miniinfer.engine.data_parallel import CacheGuess


def balance_ignored(matched, loads, n, balance):
    """Affinity always: one hot prefix sends every request to one replica, however long its queue."""
    return min(range(len(loads)), key=lambda r: (-matched[r], loads[r], r))


def ties_to_the_lowest_number(matched, loads, n, balance):
    """Among equal matches, the lowest number, not the least loaded: new prompts all go to replica 0."""
    if max(loads) - min(loads) > balance:
        return min(range(len(loads)), key=lambda r: (loads[r], r))
    return min(range(len(loads)), key=lambda r: (-matched[r], r))


def bound_reached_is_out_of_balance(matched, loads, n, balance):
    """Gives way to the load when the gap equals the bound, one request early."""
    if max(loads) - min(loads) >= balance:
        return min(range(len(loads)), key=lambda r: (loads[r], r))
    return min(range(len(loads)), key=lambda r: (-matched[r], loads[r], r))


def most_matched_when_out_of_balance(matched, loads, n, balance):
    """Out of balance, the least loaded of those with the longest match: the busy replica still wins its prefixes."""
    best = max(matched)
    return min((r for r in range(len(loads)) if matched[r] == best), key=lambda r: (loads[r], r))


class CountsEveryHeldBlock(CacheGuess):
    """Counts every held block of the prompt, not only those before the first missing one."""

    def matched(self, keys):
        return sum(k in self.hashes for k in keys)


class ForgetsTheNewest(CacheGuess):
    """Past the capacity, forgets the newest blocks: the prompt just sent is what it drops."""

    def add(self, keys):
        for key in keys:
            self.hashes[key] = None
            self.hashes.move_to_end(key)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=True)


class NeverRefreshed(CacheGuess):
    """A block already held keeps its old place: a prefix used by every request is forgotten first."""

    def add(self, keys):
        for key in keys:
            self.hashes.setdefault(key, None)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)


class KeepsTheLastPromptOnly(CacheGuess):
    """Believes a replica holds only the last prompt sent to it: a conversation's turns lose their replica."""

    def add(self, keys):
        self.hashes.clear()
        super().add(keys)


def _plan(config, spread_even_when_named=False, tensor_parallel_shares=False, equal_shares=False):
    """The exercise's answer, with one of the mistakes below switched on."""
    n, one = config.data_parallel_size, dataclasses.replace(config, data_parallel_size=1)
    device = torch.device(config.device)
    if device.type != "cuda":
        return [one] * n
    if config.tensor_parallel_size > 1 and not tensor_parallel_shares:
        raise ValueError("each replica's ranks would take the same GPUs")
    if (device.index is None or spread_even_when_named) and torch.cuda.device_count() >= n:
        return [dataclasses.replace(one, device=f"cuda:{r}") for r in range(n)]
    share = (lambda r: 1 / n) if equal_shares else (lambda r: (r + 1) / n)
    return [dataclasses.replace(one, gpu_memory_utilization=config.gpu_memory_utilization * share(r)) for r in range(n)]


def replicas_keep_data_parallel_size(config):
    """Copies the config whole: each replica's engine would itself ask for data_parallel_size replicas."""
    return [dataclasses.replace(c, data_parallel_size=config.data_parallel_size) for c in _plan(config)]


def equal_shares_of_one_gpu(config):
    """Gives every replica on a shared GPU 1 / R of gpu_memory_utilization: the later ones count the earlier
    ones' memory as used and get almost nothing."""
    return _plan(config, equal_shares=True)


def a_gpu_each_even_when_named(config):
    """Spreads the replicas over the GPUs even when the config names one (cuda:1): the user's choice ignored."""
    return _plan(config, spread_even_when_named=True)


def tensor_parallel_allowed(config):
    """Lets tensor-parallel replicas share GPUs: both replicas' rank 0 would land on cuda:0."""
    return _plan(config, tensor_parallel_shares=True)


def equal_counts(costs, head, stages):
    """As many layers a stage, the head forgotten: the last stage of a small model reads the most."""
    n = len(costs)
    bounds = [round(s * n / stages) for s in range(stages + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def head_ignored(costs, head, stages):
    """The layers balanced as if the last stage held no LM head."""
    return split_layers(costs, 0.0, stages)


def fill_to_the_average(costs, head, stages):
    """Greedy: each stage takes layers until it reaches the average share, the rest to the last."""
    share, plan, start = (sum(costs) + head) / stages, [], 0
    for s in range(stages - 1):
        end, cost = start + 1, costs[start]
        while end < len(costs) - (stages - 1 - s) and cost + costs[end] <= share:
            cost, end = cost + costs[end], end + 1
        plan.append(range(start, end))
        start = end
    return plan + [range(start, len(costs))]


def _keep(model, layers, first, last, head_everywhere=False, untie=False, one_more=False):
    """The exercise's answer, with one of the mistakes below switched on."""
    for i in range(len(model.model.layers)):
        if i not in layers and not (one_more and i == layers.stop):
            model.model.layers[i] = nn.Module()
    if not first and not (last and model.cfg.tie_word_embeddings and not untie):
        model.model.embed_tokens = nn.Module()
    if not last and not head_everywhere:
        model.lm_head = nn.Module()


def head_on_every_stage(model, layers, first, last):
    """Every stage keeps the LM head: each reads the largest matrix of a small model for nothing."""
    _keep(model, layers, first, last, head_everywhere=True)


def tied_head_dropped(model, layers, first, last):
    """The last stage drops the embedding even where the head is the embedding (tied): it holds no head."""
    _keep(model, layers, first, last, untie=True)


def one_layer_too_many(model, layers, first, last):
    """Keeps the layer after its range too (layers.stop as if it were inside): read twice, by two stages."""
    _keep(model, layers, first, last, one_more=True)


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_cache_aware, balance_ignored),
    (testing.check_cache_aware, ties_to_the_lowest_number),
    (testing.check_cache_aware, bound_reached_is_out_of_balance),
    (testing.check_cache_aware, most_matched_when_out_of_balance),
    (testing.check_cache_guess, CountsEveryHeldBlock),
    (testing.check_cache_guess, ForgetsTheNewest),
    (testing.check_cache_guess, NeverRefreshed),
    (testing.check_cache_guess, KeepsTheLastPromptOnly),
    (testing.check_replica_configs, replicas_keep_data_parallel_size),
    (testing.check_replica_configs, equal_shares_of_one_gpu),
    (testing.check_replica_configs, a_gpu_each_even_when_named),
    (testing.check_replica_configs, tensor_parallel_allowed),
    (testing.check_split_layers, equal_counts),
    (testing.check_split_layers, head_ignored),
    (testing.check_split_layers, fill_to_the_average),
    (testing.check_keep_stage, head_on_every_stage),
    (testing.check_keep_stage, tied_head_dropped),
    (testing.check_keep_stage, one_layer_too_many),
]
