"""Wrong answers to the capstone that its check must reject: engines that are faster by serving other tokens."""

import dataclasses

import miniinfer as mi
from miniinfer.course import checks as testing


def weights_in_int8(config):
    """Quantizes the weights to int8 (chapter 10): a faster step on a GPU, and other greedy tokens."""
    return mi.LLMEngine(dataclasses.replace(config, quantization="int8"))


class StopsOneTokenEarly(mi.LLMEngine):
    """Serves every request one token fewer than it asked for: a step saved, an answer cut short."""

    def generate(self, prompts, params=None, use_tqdm=True):
        return super().generate(prompts, dataclasses.replace(params, max_tokens=params.max_tokens - 1), use_tqdm)


class PenalizesRepeats(mi.LLMEngine):
    """Adds a repetition penalty to keep the model from looping: not the greedy tokens it was asked for."""

    def generate(self, prompts, params=None, use_tqdm=True):
        return super().generate(prompts, dataclasses.replace(params, repetition_penalty=1.3), use_tqdm)


# (the check, the wrong answer)
MUTANTS = [
    (testing.check_capstone, weights_in_int8),
    (testing.check_capstone, StopsOneTokenEarly),
    (testing.check_capstone, PenalizesRepeats),
]
