from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from miniinfer.block_manager import blocks_needed
from miniinfer.config import EngineConfig
from miniinfer.course_model import course_model_path
from miniinfer.engine import RUNNERS
from miniinfer.loader import CheckpointError, load_model, load_tokenizer
from miniinfer.model import Registry, Transformer
from miniinfer.model_runner import DecodeGraphs, Launched, ModelRunner, SpecStats
from miniinfer.sampler import SamplingBatch, exponential_noise, sampling_probs
from miniinfer.scheduler import SchedulerOutput
from miniinfer.varlen import VarlenBatch, VarlenKVCache, to_device

# Each request's seed XOR one of these gives the noise of the draft's choice and of the acceptance
# test: independent of the noise that samples the token itself, as the proof of exactness needs.
DRAFT_NOISE = 0x5BD1E995
ACCEPT_NOISE = 0x27D4EB2F


def uniform(s: SamplingBatch, stream: int) -> torch.Tensor:
    """One uniform number in (0, 1) per row [R], a function of the row's (seed, step) and stream."""
    return (-exponential_noise(s.seeds ^ stream, s.steps, 1)[:, 0]).exp()


def draw(logits: torch.Tensor, probs: torch.Tensor | None, s: SamplingBatch, stream: int = 0) -> torch.Tensor:
    """A token per row from probs [R, vocab] (weights: they need not sum to 1), by the seeded race of
    chapter 06; argmax of logits for greedy rows (and all rows when probs is None)."""
    greedy = logits.argmax(-1)
    if probs is None:
        return greedy
    tokens = (probs / exponential_noise(s.seeds ^ stream, s.steps, probs.shape[-1])).argmax(-1)
    return torch.where(s.temperature > 0, tokens, greedy)


def verify(logits: torch.Tensor, s: SamplingBatch, guesses: torch.Tensor,
           q: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling. Row r of logits [R, vocab] is the target's at a position where guesses[r]
    was proposed (-1: none, the row after a request's last guess), drawn from q[r] [R, vocab] (None:
    proposed outright, q one-hot). Returns accepted [R]: the guess is kept with probability
    min(1, p/q); and tokens [R]: what is sampled there when it is not, from norm(max(0, p - q)), or
    from p where there was no guess. Greedy rows keep a guess equal to the argmax and sample the argmax."""
    has = guesses >= 0
    g = guesses.clamp(min=0)[:, None]
    greedy = logits.argmax(-1)
    greedy_accept = has & (greedy == g[:, 0])
    if not s.any_random:
        return greedy_accept, greedy
    p = sampling_probs(logits, s)
    p_g = p.gather(-1, g)[:, 0]
    if q is None:
        q_g = torch.ones_like(p_g)
        residual = torch.where(has[:, None], p.scatter(-1, g, 0.0), p)
    else:
        q_g = q.gather(-1, g)[:, 0]
        residual = (p - q).clamp(min=0)  # q's rows without a guess are zeros: p itself
    # u < p/q without dividing (q may be 0 where p is too).
    accept = has & (uniform(s, ACCEPT_NOISE) * q_g <= p_g)
    # p equal to q up to rounding leaves nothing to correct with: then p is the right law anyway.
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p)
    random = s.temperature > 0
    return torch.where(random, accept, greedy_accept), draw(logits, residual, s)


def num_accepted(accepted: list[bool]) -> int:
    """The guesses kept: those before the first rejected one."""
    n = 0
    while n < len(accepted) and accepted[n]:
        n += 1
    return n


def ngram_guesses(tokens: list[int], k: int, max_n: int = 3, min_n: int = 1) -> list[int]:
    """Up to k guesses: the tokens that followed the latest earlier occurrence of the last n tokens,
    trying the longest n first (prompt lookup: no model)."""
    ids = np.asarray(tokens)
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)  # each followed by a token
        hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
        if len(hits):
            start = hits[-1] + n
            return ids[start:start + k].tolist()
    return []


class Proposer:
    """Guesses at the next tokens of the requests a step leaves room for."""

    def propose(self, runner: SpeculativeRunner, out: SchedulerOutput,
                room: dict[str, int]) -> tuple[dict[str, list[int]], torch.Tensor | None]:
        """Up to room[rid] guesses for each request with room, and the distributions they were drawn
        from, [requests with room, max room, vocab] in the order of room (None: proposed outright).
        Called before the target's forward, at every step."""
        raise NotImplementedError

    def allocate(self, runner: SpeculativeRunner, num_blocks: int) -> None:
        """Memory once the pool size is known."""

    def bytes_per_block(self) -> int:
        return 0

    def rewind(self, rid: str, num_tokens: int) -> None:
        """Only rid's first num_tokens tokens are still valid (the rest were rejected)."""

    def forget(self, rid: str) -> None:
        """rid finished or was preempted."""


class NgramProposer(Proposer):
    def __init__(self, config: EngineConfig, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, runner, out, room):
        return {rid: ngram_guesses(runner.requests[rid].token_ids, k, self.max_n, self.min_n)
                for rid, k in room.items()}, None


def model_folder(name: str | Path | None) -> Path:
    """A checkpoint folder, or an embedded course model's by name (None: the course model)."""
    if name is None or Path(name).is_dir():
        return course_model_path() if name is None else Path(name)
    return course_model_path(str(name))


def check_draft(target: Path, draft: Path) -> None:
    """ValueError unless the draft can propose for the target: the same vocabulary and, where both
    ship a tokenizer, the same tokenizer. Reads config and tokenizer files only."""
    sizes = []
    for folder in (target, draft):
        if not (folder / "config.json").is_file():
            raise CheckpointError(f"{folder}: no config.json (is this a Hugging Face checkpoint folder?)")
        sizes.append(json.loads((folder / "config.json").read_text()).get("vocab_size"))
    if sizes[0] != sizes[1]:
        raise ValueError(f"the draft {draft} has a vocabulary of {sizes[1]} tokens, the model {sizes[0]}: "
                         "speculation needs a draft with the model's tokenizer")
    vocabs = []
    for folder in (target, draft):
        try:
            vocabs.append(load_tokenizer(folder).get_vocab())
        except (OSError, ValueError):  # no tokenizer files: token ids only
            return
    if vocabs[0] != vocabs[1]:
        raise ValueError(f"the draft {draft} has another tokenizer than the model: its guesses would be "
                         "other tokens' ids")


class DraftProposer(Proposer):
    """A small model of the same tokenizer, run in the engine: it computes every token the target
    computes (its own K/V, in its own pool under the same block ids), then decodes k guesses."""

    def __init__(self, config: EngineConfig):
        self.folder = model_folder(config.speculative_model)
        check_draft(model_folder(config.model), self.folder)
        self.config = config
        self.computed: dict[str, int] = {}  # request -> its tokens whose draft K/V are in the pool

    def load(self, runner: ModelRunner) -> None:
        cfg = json.loads((self.folder / "config.json").read_text())
        if cfg.get("vocab_size") != runner.model.cfg.vocab_size:
            raise ValueError(f"the draft {self.folder} has a vocabulary of {cfg.get('vocab_size')} tokens, "
                             f"the model {runner.model.cfg.vocab_size}")
        if cfg.get("max_position_embeddings", 0) < runner.max_model_len:
            raise ValueError(f"the draft {self.folder} has a context of {cfg.get('max_position_embeddings')} "
                             f"tokens, less than max_model_len={runner.max_model_len}")
        self.model = load_model(self.folder, runner.device, runner.model.dtype)
        self.kv_dtype = self.config.kv_cache_dtype or self.model.dtype

    def bytes_per_block(self) -> int:
        cfg = self.model.cfg
        return 2 * cfg.num_layers * self.config.block_size * cfg.num_kv_heads * cfg.head_dim * self.kv_dtype.itemsize

    def allocate(self, runner, num_blocks):
        config = self.config
        self.cache = VarlenKVCache(self.model.cfg, num_blocks, config.block_size, runner.device, self.kv_dtype,
                                   config.kernels)
        self.graphs = (DecodeGraphs(self.model, self.cache, config.max_num_seqs, runner.max_model_len)
                       if runner.graphs is not None else None)

    def forward(self, batch: VarlenBatch, logits_at: torch.Tensor) -> torch.Tensor:
        if self.graphs is not None and batch.max_query_len == 1:
            return self.graphs(batch)[logits_at]
        self.cache.step(batch)
        return self.model(batch.input_ids[None], batch.positions[None], attn=self.cache, logits_at=logits_at)

    def propose(self, runner, out, room):
        # Catch up: every token the target computes this step (and the last one or two of a request
        # whose guesses were all accepted), with logits where the requests with room end.
        ids, counts = list(out.num_new_tokens), list(out.num_new_tokens.values())
        reqs = [runner.requests[rid] for rid in ids]
        starts = [self.computed.setdefault(rid, r.num_computed_tokens) for rid, r in zip(ids, reqs)]
        stops = [r.num_computed_tokens + n - room.get(rid, 0) for rid, r, n in zip(ids, reqs, counts)]
        tokens = [r.token_ids[a:b] for r, a, b in zip(reqs, starts, stops)]
        tables, widths = runner.rows.gather([r.row for r in reqs], [r.block_ids for r in reqs])
        device, bs = runner.device, self.config.block_size
        batch = VarlenBatch.from_arrays(tokens, tables, widths, starts, bs, device)
        spec = [i for i, rid in enumerate(ids) if rid in room]
        ends = np.cumsum([len(t) for t in tokens]) - 1
        logits = self.forward(batch, to_device(ends[spec], device))
        for rid, stop in zip(ids, stops):
            self.computed[rid] = stop
        if not spec:
            return {}, None
        # Then up to k steps of one token each, for the requests with room for them.
        S, spec_idx = len(spec), np.array(spec)
        k = np.array([room[ids[i]] for i in spec])
        first_step = np.array([len(reqs[i].token_ids) - reqs[i].num_prompt_tokens for i in spec])
        values = runner.rows.sampling[:, [reqs[i].row for i in spec]]
        vocab = self.model.cfg.vocab_size
        drawn = torch.full((S, int(k.max())), -1, dtype=torch.long, device=device)
        q_all = None
        active = np.arange(S)
        for j in range(int(k.max())):
            s = SamplingBatch.build(values[:, active], first_step[active] + j, vocab, device)
            q = sampling_probs(logits, s) if s.any_random else None
            g = draw(logits, q, s, DRAFT_NOISE)
            rows = to_device(active, device)
            drawn[rows, j] = g
            if q is not None:
                if q_all is None:
                    q_all = torch.zeros(S, drawn.shape[1], vocab, device=device)
                q_all[rows, j] = q
            going = k[active] > j + 1
            if not going.any():
                break
            active, g = active[going], g[to_device(np.flatnonzero(going), device)]
            # Guess j+1 sits right after the known tokens and guesses 1..j.
            positions = [stops[spec[a]] + j for a in active]
            batch = VarlenBatch.from_arrays([[0]] * len(active), tables[spec_idx[active]], widths[spec_idx[active]],
                                            positions, bs, device)
            batch.input_ids.copy_(g)
            logits = self.forward(batch, torch.arange(len(active), device=device))
            for a in active:
                self.computed[ids[spec[a]]] += 1
        table = drawn.tolist()
        return {ids[i]: row[:room[ids[i]]] for i, row in zip(spec, table)}, q_all

    def rewind(self, rid, num_tokens):
        self.computed[rid] = min(self.computed[rid], num_tokens)

    def forget(self, rid):
        self.computed.pop(rid, None)


PROPOSERS = Registry("speculative_method", {"draft": DraftProposer, "ngram": NgramProposer})


@dataclass
class Verified(Launched):
    """A step with guesses, already read (speculation runs without overlap)."""
    sampled: dict[str, list[int]]


class SpeculativeRunner(ModelRunner):
    """Chapter 06's runner, with a proposer's guesses verified in the step's one forward."""

    def __init__(self, config: EngineConfig, model: Transformer | None = None):
        self.proposer = PROPOSERS[config.speculative_method](config)  # its checks before any loading
        super().__init__(config, model)
        if isinstance(self.proposer, DraftProposer):
            self.proposer.load(self)
        self.spec = SpecStats()

    def kv_bytes_per_block(self) -> int:
        return super().kv_bytes_per_block() + self.proposer.bytes_per_block()

    def allocate_kv_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        super().allocate_kv_cache(num_blocks, num_cpu_blocks)
        self.proposer.allocate(self, num_blocks)

    def update_states(self, out: SchedulerOutput) -> None:
        super().update_states(out)
        for rid in out.finished_ids:
            self.proposer.forget(rid)

    def start(self, out: SchedulerOutput) -> Launched:
        room = {rid: out.num_spec_tokens[rid] for rid in out.num_new_tokens if rid in out.num_spec_tokens}
        guesses, q = self.proposer.propose(self, out, room)
        if not room:
            return super().start(out)
        ids, counts = list(out.num_new_tokens), list(out.num_new_tokens.values())
        reqs = [self.requests[rid] for rid in ids]
        known = [len(r.token_ids) for r in reqs]
        for rid, g in guesses.items():
            self.requests[rid].token_ids += g
        step = self.prepare(out)
        # Logits at the row of each request's last known token and of each of its guesses.
        m = np.array([len(guesses.get(rid, ())) for rid in ids])
        lens = [min(n, len(r.token_ids) - r.num_computed_tokens) for r, n in zip(reqs, counts)]
        last = np.cumsum(lens) - 1
        first = np.cumsum(m + 1) - (m + 1)  # each request's first verified row
        rows = np.concatenate([np.arange(e - k, e + 1) for e, k in zip(last, m)])
        owner = np.repeat(np.arange(len(ids)), m + 1)
        j = np.arange(len(rows)) - first[owner]  # 0..m_i within request i
        guess_rows = np.full(len(rows), -1)
        has = j < m[owner]
        guess_rows[has] = [reqs[i].token_ids[known[i] + jj] for i, jj in zip(owner[has], j[has])]
        steps = np.array([k - r.num_prompt_tokens for k, r in zip(known, reqs)])[owner] + j
        vocab = self.model.cfg.vocab_size
        s = SamplingBatch.build(self.rows.sampling[:, np.array(step.rows)[owner]], steps, vocab, self.device)
        self.cache.step(step.batch)
        logits = self.model(step.batch.input_ids[None], step.batch.positions[None], attn=self.cache,
                            logits_at=to_device(rows, self.device))
        q_rows = None
        if q is not None:
            spec_of = {rid: a for a, rid in enumerate(room)}
            q_rows = torch.zeros(len(rows), vocab, device=self.device)
            which = np.stack([[spec_of[ids[i]] for i in owner[has]], j[has], np.flatnonzero(has)])
            a, jj, at = to_device(which, self.device)
            q_rows[at] = q[a, jj]
        accepted, tokens = verify(logits, s, to_device(guess_rows, self.device), q_rows)
        acc, tok = accepted.tolist(), tokens.tolist()
        sampled = {}
        for i, (rid, r, n) in enumerate(zip(ids, reqs, counts)):
            c, f = r.num_computed_tokens, first[i]
            if rid in room:
                a = num_accepted(acc[f:f + m[i]])
                sampled[rid] = r.token_ids[known[i]:known[i] + a] + [tok[f + a]]
                r.token_ids[known[i]:] = sampled[rid]
                r.num_computed_tokens = known[i] + a
                # The scheduler truncates its table by the same rule.
                r.block_ids = r.block_ids[:blocks_needed(r.num_computed_tokens, self.config.block_size)]
                # Its row in BatchRows too: a block given back may come back as another.
                self.rows.widths[r.row] = min(self.rows.widths[r.row], len(r.block_ids))
                self.proposer.rewind(rid, r.num_computed_tokens)
                self.spec.proposed += int(m[i])
                self.spec.accepted += a
                self.spec.verified += 1
            else:
                r.num_computed_tokens = c + n
                if c + n == known[i]:  # it reached the end of its tokens: it samples
                    r.token_ids.append(tok[f])
                    sampled[rid] = [tok[f]]
        return Verified(step, [], tokens, None, sampled)

    def collect(self, launched: Launched | None) -> dict[str, list[int]]:
        if isinstance(launched, Verified):
            return launched.sampled
        return super().collect(launched)


RUNNERS["draft"] = RUNNERS["ngram"] = SpeculativeRunner
