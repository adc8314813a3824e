#!/usr/bin/env python3
"""Seeded allocation traces of several workload shapes, for bench/replay.cc and the peers.

Each workload stands for a real program's pattern of GPU allocations (its docstring says
which, and what its parameters mean). The output is what bench/replay.cc,
bench/vmm_peer_bench.cc and bench/torch_peer_bench.cpp read: one event per line,
`a ID BYTES` (allocate) or `f ID` (free). Every ID is allocated once and freed at most once;
what is still live at the end stays live (the replay frees it, untimed). The same name, seed,
scale and parameters always give the same bytes.

    python3 bench/traces.py --list                      # the workloads, one a line
    python3 bench/traces.py kv_serving > trace.txt      # seed 0, default scale
    python3 bench/traces.py churn --seed 3 --scale 0.1 > small.txt
    python3 bench/traces.py inference_varying --set layers=8 --stats   # events and peak only

`--scale F` multiplies the trace's length (the steps, buffers, batches, iterations or
documents of the workload; at least one), not its buffer sizes, so peak live bytes stay of
the same order. `--set
NAME=VALUE` (repeatable) overrides a parameter of the workload's function. At the default
scale every trace has at most about 100,000 events and peak live bytes between a few GiB and
about 20 GiB, so that one replay takes seconds. bench/README.md has the table of the suite;
bench/trace_suite.sh replays every trace through vmm and its peers.
"""
import argparse
import heapq
import inspect
import math
import random
import re
import sys

import training_trace  # the training trace's own generator, beside this file

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

WORKLOADS = {}  # name -> Workload
# Each workload's docstring ends with its figures at the defaults, in this form.
_DEFAULTS_LINE = re.compile(
    r"Defaults: (?P<events>[\d,]+) events, peak live (?P<peak>[\d.]+) GiB with seed 0 "
    r"\((?P<lo>[\d.]+) to (?P<hi>[\d.]+) GiB over seeds\)\.")


class Workload:
    """A registered generator: `fn(rec, seed, **params)` emits events through `rec`."""

    def __init__(self, fn, length):
        self.name = fn.__name__
        self.fn = fn
        self.length = length          # the parameter --scale multiplies
        self.doc = inspect.getdoc(fn)
        m = _DEFAULTS_LINE.search(self.doc)
        if m is None:
            raise ValueError(f"{self.name}'s docstring lacks its 'Defaults: ...' line")
        # What the docstring promises at the default scale.
        self.events = int(m["events"].replace(",", ""))
        self.peak_gib_seed0 = float(m["peak"])
        self.peak_gib_range = (float(m["lo"]), float(m["hi"]))
        self.defaults = {
            name: p.default
            for name, p in inspect.signature(fn).parameters.items()
            if p.kind == p.KEYWORD_ONLY
        }

    @property
    def summary(self):
        return self.doc.splitlines()[0]

    def params(self, scale=1.0, overrides=None):
        """The parameters of a run: defaults, then `overrides`, then the length scaled."""
        params = dict(self.defaults)
        for key, value in (overrides or {}).items():
            if key not in params:
                raise ValueError(f"{self.name} has no parameter {key!r} "
                                 f"(it has {', '.join(sorted(params))})")
            params[key] = value
        params[self.length] = max(1, int(round(params[self.length] * scale)))
        return params


def workload(length):
    def register(fn):
        WORKLOADS[fn.__name__] = Workload(fn, length)
        return fn
    return register


class Recorder:
    """Hands out IDs and passes each event to `sink(op, ident, nbytes)` (nbytes 0 for a
    free)."""

    def __init__(self, sink):
        self.sink = sink
        self.next_id = 0

    def alloc(self, nbytes):
        nbytes = int(nbytes)
        if nbytes <= 0:
            raise ValueError(f"allocation of {nbytes} bytes")
        ident = self.next_id
        self.next_id += 1
        self.sink("a", ident, nbytes)
        return ident

    def free(self, ident):
        self.sink("f", ident, 0)

    def free_all(self, idents):
        for ident in idents:
            self.sink("f", ident, 0)


def _round_up(n, multiple):
    return -(-n // multiple) * multiple


def _clamp(v, lo, hi):
    return max(lo, min(hi, v))


def _lognormal_int(rng, median, sigma, lo, hi):
    return _clamp(int(rng.lognormvariate(math.log(median), sigma)), lo, hi)


# ---------------------------------------------------------------------------------------------
# The workloads.


@workload(length="steps")
def training(rec, seed, *, steps=60, layers=24, hidden=4096):
    """Transformer training with a variable sequence length (bench/training_trace.py).

    Exactly the events of bench/training_trace.py for the same seed and parameters: each
    step picks a sequence length (256..4096 times 1, 2 or 4), allocates three activations per
    layer that live until the backward pass (1x, 1x and 4x seq*hidden*2 bytes) and one
    temporary that dies at once, then walks the layers backwards, allocating a gradient,
    freeing the activation and freeing the gradient. Everything is freed by the end of a
    step.

    steps: training steps (--scale multiplies it); layers, hidden: the model's depth and
    width.

    Defaults: 20,160 events, peak live 18.375 GiB with seed 0 (12 to 19 GiB over seeds).
    """
    for op, ident, nbytes in training_trace.events(seed, steps, layers, hidden):
        rec.sink(op, ident, nbytes)


@workload(length="steps")
def kv_serving(rec, seed, *, steps=4500, arrival_rate=0.14, max_batch=64, prompt_median=512,
               output_median=256, max_context=8192, layers=32, hidden=4096, heads=32,
               kv_heads=8, head_dim=128, intermediate=14336, vocab=128256, page_tokens=16,
               growth=1.5):
    """LLM serving with continuous batching and a per-request KV cache grown by reallocation.

    Stands for a simple LLM server (an 8B model with grouped-query attention, Llama-3-8B's
    shape) that keeps each request's KV cache in one tensor and grows it geometrically: when
    a request's tokens outgrow the cache, a block `growth` times larger (rounded up to
    `page_tokens` tokens) is allocated, the cache copied into it and the old block freed.
    Requests arrive as a Poisson process (`arrival_rate` per decode step) with lognormal
    prompt and output lengths (medians `prompt_median`, `output_median`; prompt plus output
    at most `max_context` tokens) and wait while `max_batch` requests are running. A newly
    admitted request is prefilled (activation temporaries sized by its prompt, then its KV
    cache for the prompt); then every decode step allocates and frees the step's
    temporaries, sized by the batch: hidden states, QKV, attention scores (fp32, batch x
    heads x longest context), the MLP's gate and up projections, logits and probabilities
    (fp32, batch x vocab) and the sampled tokens. A finished request frees its cache.
    Weights are loaded before the trace starts and are not part of it.

    steps: decode steps (--scale multiplies it); the model: layers, hidden, heads, kv_heads,
    head_dim, intermediate, vocab (bf16 activations and cache).

    Defaults: 82,938 events, peak live 12.721 GiB with seed 0 (10 to 14 GiB over seeds).
    """
    rng = random.Random(seed)
    kv_per_token = 2 * layers * kv_heads * head_dim * 2
    qkv_width = hidden + 2 * kv_heads * head_dim
    waiting = []   # (prompt, output) of requests not yet admitted, in arrival order
    active = []    # [prompt, output, generated, capacity, cache ID]
    next_arrival = rng.expovariate(arrival_rate)

    def capacity_for(tokens):
        return _round_up(tokens, page_tokens)

    for step in range(steps):
        while next_arrival <= step:
            prompt = _lognormal_int(rng, prompt_median, 1.0, 16, max_context // 2)
            output = _lognormal_int(rng, output_median, 0.8, 1, max_context - prompt)
            waiting.append((prompt, output))
            next_arrival += rng.expovariate(arrival_rate)
        # Admit and prefill, one request at a time.
        while waiting and len(active) < max_batch:
            prompt, output = waiting.pop(0)
            x = rec.alloc(prompt * hidden * 2)
            qkv = rec.alloc(prompt * qkv_width * 2)
            attn = rec.alloc(prompt * hidden * 2)
            rec.free(qkv)
            mlp = rec.alloc(prompt * 2 * intermediate * 2)
            rec.free(attn)
            capacity = capacity_for(prompt + 1)
            cache = rec.alloc(capacity * kv_per_token)
            rec.free(mlp)
            last = rec.alloc(hidden * 2)
            rec.free(x)
            logits = rec.alloc(vocab * 4)
            rec.free(last)
            rec.free(logits)
            active.append([prompt, output, 1, capacity, cache])
        if not active:
            continue
        # One decode step for the batch.
        batch = len(active)
        context = max(r[0] + r[2] for r in active)
        x = rec.alloc(batch * hidden * 2)
        qkv = rec.alloc(batch * qkv_width * 2)
        scores = rec.alloc(batch * heads * context * 4)
        attn = rec.alloc(batch * hidden * 2)
        rec.free(scores)
        rec.free(qkv)
        mlp = rec.alloc(batch * 2 * intermediate * 2)
        rec.free(attn)
        rec.free(mlp)
        logits = rec.alloc(batch * vocab * 4)
        rec.free(x)
        probs = rec.alloc(batch * vocab * 4)
        rec.free(logits)
        tokens = rec.alloc(batch * 8)
        rec.free(probs)
        rec.free(tokens)
        still = []
        for r in active:
            r[2] += 1
            if r[2] >= r[1]:
                rec.free(r[4])
                continue
            if r[0] + r[2] > r[3]:
                r[3] = capacity_for(max(r[0] + r[2], int(r[3] * growth)))
                grown = rec.alloc(r[3] * kv_per_token)
                rec.free(r[4])
                r[4] = grown
            still.append(r)
        active = still


@workload(length="allocations")
def churn(rec, seed, *, allocations=45000, min_bytes=4 * KIB, max_bytes=GIB,
          short_lifetime=12, medium_fraction=0.04, medium_lifetime=1500, long_fraction=0.001,
          max_live_gib=16.0):
    """Long-running churn without structure: log-uniform sizes, mostly short lifetimes.

    Stands for a long-lived process that runs unrelated work one after another for a long
    time (a notebook kernel or a service that loads, runs and drops models and jobs), where
    sizes follow no pattern and a few buffers outlive everything around them. Each
    allocation's size is log-uniform between `min_bytes` and `max_bytes` (any byte count);
    its lifetime, counted in later allocations, is exponential with mean `short_lifetime`,
    or with mean `medium_lifetime` for a fraction `medium_fraction`, or, for a fraction
    `long_fraction` (a few dozen buffers), between 30% and 100% of the whole trace (those
    past the end are never freed). Live bytes never exceed `max_live_gib`: when a buffer would
    go over, the live buffers due to die soonest are freed first (a program under memory
    pressure waiting for its work to finish).

    allocations: how many buffers (--scale multiplies it).

    Defaults: 89,905 events, peak live 11.619 GiB with seed 0 (10 to 16 GiB over seeds).
    """
    rng = random.Random(seed)
    lo, hi = math.log(min_bytes), math.log(max_bytes)
    cap = int(max_live_gib * GIB)
    deaths = []   # (allocation index it dies at, ID)
    size_of = {}
    live = 0
    for t in range(allocations):
        while deaths and deaths[0][0] <= t:
            _, ident = heapq.heappop(deaths)
            rec.free(ident)
            live -= size_of.pop(ident)
        nbytes = int(math.exp(rng.uniform(lo, hi)))
        while deaths and live + nbytes > cap:
            _, ident = heapq.heappop(deaths)
            rec.free(ident)
            live -= size_of.pop(ident)
        r = rng.random()
        if r < long_fraction:
            lifetime = int(allocations * rng.uniform(0.3, 1.0))
        elif r < long_fraction + medium_fraction:
            lifetime = 1 + int(rng.expovariate(1.0 / medium_lifetime))
        else:
            lifetime = 1 + int(rng.expovariate(1.0 / short_lifetime))
        ident = rec.alloc(nbytes)
        size_of[ident] = nbytes
        live += nbytes
        if t + lifetime < allocations:
            heapq.heappush(deaths, (t + lifetime, ident))


def _rms_norm(rec, tokens, hidden):
    """An RMSNorm of `tokens` rows: its fp32 variance, then the bf16 output (returned)."""
    var = rec.alloc(tokens * 4)
    out = rec.alloc(tokens * hidden * 2)
    rec.free(var)
    return out


def _qkv(rec, tokens, hidden, kv_dim):
    """The attention projections of `tokens` rows (bf16): q, k, v."""
    return (rec.alloc(tokens * hidden * 2), rec.alloc(tokens * kv_dim * 2),
            rec.alloc(tokens * kv_dim * 2))


def _llm_weights(rec, layers, hidden, kv_dim, intermediate, vocab, dtype_bytes=2):
    """Allocates a decoder's weights tensor by tensor (embedding, per layer: q, k, v, o, gate,
    up, down, two norms; final norm, LM head) and returns their IDs and sizes."""
    shapes = [vocab * hidden]
    for _ in range(layers):
        shapes += [hidden * hidden, hidden * kv_dim, hidden * kv_dim, hidden * hidden,
                   hidden * intermediate, hidden * intermediate, intermediate * hidden,
                   hidden, hidden]
    shapes += [hidden, vocab * hidden]
    return [(rec.alloc(n * dtype_bytes), n * dtype_bytes) for n in shapes]


@workload(length="batches")
def inference_varying(rec, seed, *, batches=90, layers=28, hidden=3072, heads=24, kv_heads=8,
                      head_dim=128, intermediate=8192, vocab=128256, max_tokens=16384,
                      min_seq=32, max_seq=4096):
    """Batched inference (forward only) with varying batch size and sequence length.

    Stands for a model server or offline scorer running a 3B decoder (Llama-3.2-3B's shape,
    bf16) over requests of any size: the weights are allocated once at the start, tensor by
    tensor, and never freed; then each batch picks a batch size (1..32, powers of two) and a
    sequence length (log-uniform `min_seq`..`max_seq`, the batch cut to `max_tokens`
    tokens), and the forward pass allocates and frees activations layer by layer as an eager
    PyTorch model does: norm (and its fp32 variance), Q, K, V, rotary copies, the attention
    output and its log-sum-exp, the output projection, the residual sum, the MLP's gate, up,
    SiLU and product, the down projection and the next residual. The batch ends with the
    last token's logits (fp32).

    batches: forward passes (--scale multiplies it); the model: layers, hidden, heads,
    kv_heads, head_dim, intermediate, vocab.

    Defaults: 96,735 events, peak live 7.560 GiB with seed 0 (7 to 8 GiB over seeds).
    """
    rng = random.Random(seed)
    kv_dim = kv_heads * head_dim
    _llm_weights(rec, layers, hidden, kv_dim, intermediate, vocab)
    lo, hi = math.log(min_seq), math.log(max_seq)
    for _ in range(batches):
        batch = rng.choice([1, 2, 4, 8, 16, 32])
        seq = int(math.exp(rng.uniform(lo, hi)))
        batch = max(1, min(batch, max_tokens // seq))
        t = batch * seq
        ids = rec.alloc(t * 8)
        x = rec.alloc(t * hidden * 2)
        rec.free(ids)
        for _ in range(layers):
            n = _rms_norm(rec, t, hidden)
            q, k, v = _qkv(rec, t, hidden, kv_dim)
            rec.free(n)
            q_rot = rec.alloc(t * hidden * 2)
            rec.free(q)
            k_rot = rec.alloc(t * kv_dim * 2)
            rec.free(k)
            attn = rec.alloc(t * hidden * 2)
            lse = rec.alloc(batch * heads * seq * 4)
            rec.free_all((q_rot, k_rot, v, lse))
            o = rec.alloc(t * hidden * 2)
            rec.free(attn)
            x2 = rec.alloc(t * hidden * 2)
            rec.free_all((x, o))
            n2 = _rms_norm(rec, t, hidden)
            gate = rec.alloc(t * intermediate * 2)
            up = rec.alloc(t * intermediate * 2)
            rec.free(n2)
            act = rec.alloc(t * intermediate * 2)
            rec.free(gate)
            prod = rec.alloc(t * intermediate * 2)
            rec.free_all((act, up))
            d = rec.alloc(t * hidden * 2)
            rec.free(prod)
            x = rec.alloc(t * hidden * 2)
            rec.free_all((x2, d))
        last = rec.alloc(batch * hidden * 2)
        rec.free(x)
        logits = rec.alloc(batch * vocab * 4)
        rec.free_all((last, logits))


@workload(length="iterations")
def rl_phases(rec, seed, *, iterations=4, layers=16, hidden=2048, heads=16, kv_heads=4,
              head_dim=128, intermediate=5632, vocab=32000, rollout_batch=64,
              prompt_median=384, response_median=192, max_response=512, block_tokens=16,
              micro_batch=4):
    """Reinforcement learning of an LLM: generation (rollout) and training phases in turn.

    Stands for RLHF / GRPO-style post-training with the policy's generation engine and its
    trainer sharing one GPU (a 0.85B decoder, bf16, Adam): each iteration first generates
    responses for `rollout_batch` prompts, then trains on them, so the memory alternates
    between many small and medium buffers and a few large ones. The weights live throughout;
    Adam's two fp32 states are allocated at the first optimizer step and live on.

    Rollout: each sequence's KV cache is a list of paged blocks of `block_tokens` tokens (all
    layers), allocated as it grows (the prompt's at once) and freed when the sequence ends
    (response lengths lognormal, median `response_median`, at most `max_response`); every
    decode step allocates and frees its temporaries sized by the running batch (hidden, QKV,
    attention output, MLP, fp32 logits and probabilities, sampled tokens). Each sequence's
    tokens and log-probabilities are kept for training. Training: micro-batches of
    `micro_batch` sequences padded to the longest; the forward pass keeps per layer what the
    backward pass needs (norm output, QKV, attention output and log-sum-exp, the MLP's gate,
    up and product), the loss needs fp32 logits; the backward pass walks the layers back,
    allocating activation gradients and, on the first micro-batch, the weights' gradients
    (bf16), and frees the layer's saved activations. The optimizer step uses a temporary per
    weight (fp32), then the gradients and the rollout's outputs are freed.

    iterations: rollout + training rounds (--scale multiplies it).

    Defaults: 93,865 events, peak live 15.675 GiB with seed 0 (14 to 20 GiB over seeds).
    """
    rng = random.Random(seed)
    kv_dim = kv_heads * head_dim
    qkv_width = hidden + 2 * kv_dim
    block_bytes = block_tokens * layers * 2 * kv_dim * 2
    weights = _llm_weights(rec, layers, hidden, kv_dim, intermediate, vocab)
    adam = []
    for _ in range(iterations):
        # --- Rollout.
        seqs = []  # [prompt, response, generated, [block IDs]]
        for _ in range(rollout_batch):
            prompt = _lognormal_int(rng, prompt_median, 0.5, 16, 2048)
            response = _lognormal_int(rng, response_median, 0.8, 1, max_response)
            seqs.append([prompt, response, 0, []])
        # Prefill, in groups of 16 prompts.
        for g in range(0, len(seqs), 16):
            group = seqs[g:g + 16]
            t = sum(s[0] for s in group)
            x = rec.alloc(t * hidden * 2)
            qkv = rec.alloc(t * qkv_width * 2)
            mlp = rec.alloc(t * 2 * intermediate * 2)
            rec.free(qkv)
            for s in group:
                for _ in range(-(-(s[0] + 1) // block_tokens)):
                    s[3].append(rec.alloc(block_bytes))
            rec.free_all((mlp, x))
        running = list(seqs)
        kept = []  # tokens and log-probabilities of finished sequences
        while running:
            batch = len(running)
            x = rec.alloc(batch * hidden * 2)
            qkv = rec.alloc(batch * qkv_width * 2)
            attn = rec.alloc(batch * hidden * 2)
            rec.free(qkv)
            mlp = rec.alloc(batch * 2 * intermediate * 2)
            rec.free_all((attn, mlp))
            logits = rec.alloc(batch * vocab * 4)
            probs = rec.alloc(batch * vocab * 4)
            rec.free(logits)
            tokens = rec.alloc(batch * 8)
            rec.free_all((probs, x, tokens))
            still = []
            for s in running:
                s[2] += 1
                if s[2] >= s[1]:
                    kept.append(rec.alloc((s[0] + s[1]) * 8))
                    kept.append(rec.alloc(s[1] * 4))
                    rec.free_all(s[3])
                    continue
                if s[0] + s[2] + 1 > len(s[3]) * block_tokens:
                    s[3].append(rec.alloc(block_bytes))
                still.append(s)
            running = still
        # --- Training.
        grads = None
        for m in range(0, len(seqs), micro_batch):
            mb = seqs[m:m + micro_batch]
            t = len(mb) * max(s[0] + s[1] for s in mb)
            x = rec.alloc(t * hidden * 2)
            saved = []
            for _ in range(layers):
                n = rec.alloc(t * hidden * 2)
                qkv = rec.alloc(t * qkv_width * 2)
                attn = rec.alloc(t * hidden * 2)
                lse = rec.alloc(t * heads * 4)
                o = rec.alloc(t * hidden * 2)
                x2 = rec.alloc(t * hidden * 2)
                rec.free_all((o, x))
                n2 = rec.alloc(t * hidden * 2)
                gate = rec.alloc(t * intermediate * 2)
                up = rec.alloc(t * intermediate * 2)
                prod = rec.alloc(t * intermediate * 2)
                d = rec.alloc(t * hidden * 2)
                x = rec.alloc(t * hidden * 2)
                rec.free_all((x2, d))
                saved.append((n, qkv, attn, lse, n2, gate, up, prod))
            logits = rec.alloc(t * vocab * 4)
            rec.free(x)
            loss = rec.alloc(t * 4)
            dlogits = rec.alloc(t * vocab * 4)
            rec.free_all((logits, loss))
            dx = rec.alloc(t * hidden * 2)
            rec.free(dlogits)
            new_grads = grads is None
            if new_grads:
                grads = [rec.alloc(weights[-1][1]), rec.alloc(weights[-2][1])]
            for i in reversed(range(layers)):
                dmlp = rec.alloc(t * intermediate * 2)
                dgate = rec.alloc(t * intermediate * 2)
                dup = rec.alloc(t * intermediate * 2)
                rec.free(dmlp)
                dn2 = rec.alloc(t * hidden * 2)
                rec.free_all((dgate, dup))
                dattn = rec.alloc(t * hidden * 2)
                dqkv = rec.alloc(t * qkv_width * 2)
                rec.free(dattn)
                dx2 = rec.alloc(t * hidden * 2)
                rec.free_all((dqkv, dn2, dx))
                dx = dx2
                if new_grads:
                    grads += [rec.alloc(nbytes) for _, nbytes in weights[1 + 9 * i:10 + 9 * i]]
                rec.free_all(saved[i])
            if new_grads:
                grads.append(rec.alloc(weights[0][1]))
            rec.free(dx)
        if not adam:
            adam = [rec.alloc(2 * nbytes) for _, nbytes in weights for _ in range(2)]
        for _, nbytes in weights:
            tmp = rec.alloc(2 * nbytes)
            rec.free(tmp)
        rec.free_all(grads)
        rec.free_all(kept)


@workload(length="documents")
def long_prefill(rec, seed, *, documents=3, contexts=(24576, 49152, 98304), chunk=4096,
                 layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128,
                 intermediate=14336, vocab=128256, head_group=4):
    """Long-context prefill in chunks: a few huge, growing buffers among many small ones.

    Stands for the prefill of long documents (about 24k to 96k tokens) by an 8B decoder
    (Llama-3-8B's shape, bf16) with eager attention, in chunks of `chunk` tokens, as a
    Hugging Face model with a dynamic cache does it. Each document's length is one of
    `contexts` (in a seeded order, each once before any repeats) less up to 15%. For every
    chunk a causal mask (1 byte per chunk token x context so far) and rotary tables are made;
    then every layer allocates its small and medium temporaries (norm variance, norm output,
    Q, K, V, the MLP's gate, up, product and down projection, residual sums), concatenates
    the chunk's K and V onto the layer's cache (new K and V tensors the size of the context
    so far, the old ones freed: the cache grows by reallocation, layer by layer), and
    computes attention `head_group` heads at a time through an explicit bf16 score matrix
    (chunk x context x head_group: the huge buffer, growing with the context) and its fp32
    row maxima (small). A document ends with the last token's logits; its cache is freed.

    documents: documents prefilled one after another (--scale multiplies it); contexts:
    their possible lengths in tokens (--set contexts=16384,32768); the model: layers, hidden,
    heads, kv_heads, head_dim, intermediate, vocab.

    Defaults: 86,532 events, peak live 15.087 GiB with seed 0 (12 to 16 GiB over seeds).
    """
    rng = random.Random(seed)
    kv_dim = kv_heads * head_dim
    order = list(contexts)
    rng.shuffle(order)
    for doc in range(documents):
        length = _round_up(int(order[doc % len(order)] * rng.uniform(0.85, 1.0)), 128)
        k_cache = [None] * layers
        v_cache = [None] * layers
        x = None
        for start in range(0, length, chunk):
            c = min(chunk, length - start)
            ctx = start + c
            ids = rec.alloc(c * 8)
            pos = rec.alloc(c * 8)
            if x is not None:
                rec.free(x)
            x = rec.alloc(c * hidden * 2)
            rec.free(ids)
            mask = rec.alloc(c * ctx)
            cos = rec.alloc(c * head_dim * 2)
            sin = rec.alloc(c * head_dim * 2)
            for i in range(layers):
                n = _rms_norm(rec, c, hidden)
                q, k, v = _qkv(rec, c, hidden, kv_dim)
                rec.free(n)
                for cache, new in ((k_cache, k), (v_cache, v)):
                    grown = rec.alloc(ctx * kv_dim * 2)
                    if cache[i] is not None:
                        rec.free(cache[i])
                    rec.free(new)
                    cache[i] = grown
                attn = rec.alloc(c * hidden * 2)
                for _ in range(heads // head_group):
                    scores = rec.alloc(c * ctx * head_group * 2)
                    row_max = rec.alloc(c * head_group * 4)
                    rec.free_all((row_max, scores))
                rec.free(q)
                o = rec.alloc(c * hidden * 2)
                rec.free(attn)
                x2 = rec.alloc(c * hidden * 2)
                rec.free_all((x, o))
                n2 = rec.alloc(c * hidden * 2)
                gate = rec.alloc(c * intermediate * 2)
                up = rec.alloc(c * intermediate * 2)
                rec.free(n2)
                prod = rec.alloc(c * intermediate * 2)
                rec.free_all((gate, up))
                d = rec.alloc(c * hidden * 2)
                rec.free(prod)
                x = rec.alloc(c * hidden * 2)
                rec.free_all((x2, d))
            rec.free_all((mask, cos, sin, pos))
        last = rec.alloc(hidden * 2)
        rec.free(x)
        logits = rec.alloc(vocab * 4)
        rec.free_all((last, logits))
        rec.free_all(k_cache)
        rec.free_all(v_cache)


@workload(length="steps")
def asr_training(rec, seed, *, steps=120, layers=16, d=512, heads=8, ff=2048, vocab=1024,
                 depth=3, fixed_secs=0):
    """Speech recognition training with dynamic batches prefetched: steps alike in shape,
    none of their activations a whole number of pages.

    Stands for a Conformer-CTC model (about 120M fp32 parameters, Adam's states made at the
    first optimizer step) trained on utterances of 2 to 30 seconds (one length a batch,
    seeded; `fixed_secs` makes every batch that long), batched to at most 48,000 feature
    frames (100 a second, 80 log-mel bins, fp32). A data loader copies each batch (features,
    lengths, targets) `depth` batches ahead, so batches outlive steps and land mid-forward.
    A step makes a SpecAugment mask, a 4x convolutional subsampler, then per block the
    feed-forward, attention (an fp32 score matrix batch x heads x T'^2, quadratic in the
    batch's length, and its softmax kept for backward; the scores freed), convolution and a
    second feed-forward, keeping the activations; the CTC loss's logits, log-softmax and
    alpha / beta tables; then the backward frees each block's activations in reverse, with
    a score-sized gradient temporary per block. Sizes follow the shapes, so almost none is a
    whole number of 8 MiB pages. With `fixed_secs` set the steps repeat exactly: a loop
    whose working set is the same every step.

    steps: training steps (--scale multiplies it); the model: layers, d, heads, ff, vocab;
    depth: batches prefetched; fixed_secs: every batch's length in seconds (0: varying).

    Defaults: 81,045 events, peak live 17.291 GiB with seed 0 (17 to 18 GiB over seeds).
    """
    rng = random.Random(seed)
    weights = []
    for _ in range(layers):
        weights += [d * ff * 4, ff * d * 4, d * d * 4 * 4, d * 2 * d * 4, d * 31 * 4, d * d * 4,
                    d * ff * 4, ff * d * 4] + [d * 4] * 10
    weights += [80 * 256 * 9 * 4, 256 * 256 * 9 * 4, 256 * 19 * d * 4, d * vocab * 4]
    for n in weights:
        rec.alloc(n)
    adam = None
    queue = []

    def load():
        secs = fixed_secs or rng.choice([2, 4, 6, 8, 12, 16, 20, 25, 30])
        frames = secs * 100
        batch = max(1, min(64, 48000 // frames))
        return (batch, frames, secs, rec.alloc(batch * frames * 80 * 4), rec.alloc(batch * 8),
                rec.alloc(batch * secs * 15 * 8))

    for _ in range(depth):
        queue.append(load())
    for _ in range(steps):
        if not queue:
            queue.append(load())
        b, frames, secs, feat, lens, tgt = queue.pop(0)
        mask = rec.alloc(b * frames * 80)
        aug = rec.alloc(b * frames * 80 * 4)
        rec.free(mask)
        t = frames // 4
        saved = [aug, rec.alloc(b * 256 * (frames // 2) * 40 * 4),
                 rec.alloc(b * 256 * t * 20 * 4)]
        x = rec.alloc(b * t * d * 4)
        for i in range(layers):
            f1, a1, f2 = (rec.alloc(b * t * ff * 4), rec.alloc(b * t * ff * 4),
                          rec.alloc(b * t * d * 4))
            n, qkv = rec.alloc(b * t * d * 4), rec.alloc(b * t * 3 * d * 4)
            scores = rec.alloc(b * heads * t * t * 4)
            probs = rec.alloc(b * heads * t * t * 4)
            o = rec.alloc(b * t * d * 4)
            rec.free(scores)
            conv = [rec.alloc(b * t * 2 * d * 4)] + [rec.alloc(b * t * d * 4) for _ in range(3)]
            f3, a3 = rec.alloc(b * t * ff * 4), rec.alloc(b * t * ff * 4)
            y = rec.alloc(b * t * d * 4)
            saved.append([f1, a1, n, qkv, probs, o] + conv + [f3, a3, f2, x])
            x = y
            if i == layers // 2 and len(queue) < depth:
                queue.append(load())  # the prefetch lands mid-forward
        logits, log_probs = rec.alloc(b * t * vocab * 4), rec.alloc(b * t * vocab * 4)
        alpha = rec.alloc(b * t * (2 * secs * 15 + 1) * 4)
        beta = rec.alloc(b * t * (2 * secs * 15 + 1) * 4)
        grad_logits = rec.alloc(b * t * vocab * 4)
        rec.free_all((alpha, beta, logits))
        dx = rec.alloc(b * t * d * 4)
        rec.free_all((grad_logits, log_probs))
        for _ in range(layers):
            kept = saved.pop()
            dff, dff2 = rec.alloc(b * t * ff * 4), rec.alloc(b * t * ff * 4)
            rec.free(dff)
            rec.free(rec.alloc(b * heads * t * t * 4))
            dq = rec.alloc(b * t * 3 * d * 4)
            rec.free_all((dq, dff2))
            ndx = rec.alloc(b * t * d * 4)
            rec.free(dx)
            rec.free_all(kept)
            dx = ndx
        rec.free(dx)
        for kept in saved:
            rec.free(kept)
        rec.free(x)
        if adam is None:
            adam = [rec.alloc(n) for n in weights for _ in range(2)]
        rec.free_all((feat, lens, tgt))
        if len(queue) < depth:
            queue.append(load())


def _sample(rec, batch, vocab):
    """One token per row drawn from bf16 logits as a sampler with top-p does: the fp32 logits,
    temperature, the sorted probabilities (values and indices), their cumulative sum and the
    mask, the filtered scores, softmax and the draw; returns the tokens (int64)."""
    logits = rec.alloc(batch * vocab * 2)
    scores = rec.alloc(batch * vocab * 4)
    rec.free(logits)
    scaled = rec.alloc(batch * vocab * 4)
    rec.free(scores)
    values, indices = rec.alloc(batch * vocab * 4), rec.alloc(batch * vocab * 8)
    probs, cumulative = rec.alloc(batch * vocab * 4), rec.alloc(batch * vocab * 4)
    mask = rec.alloc(batch * vocab)
    rec.free_all((cumulative, probs))
    filtered = rec.alloc(batch * vocab * 4)
    rec.free_all((values, indices, mask, scaled))
    softmax = rec.alloc(batch * vocab * 4)
    rec.free(filtered)
    tokens = rec.alloc(batch * 8)
    rec.free(softmax)
    return tokens


@workload(length="batches")
def hf_generate(rec, seed, *, batches=8, layers=16, hidden=2048, kv_heads=8, head_dim=64,
                intermediate=8192, vocab=128256, prompt_median=1500, max_new=24):
    """Text generation as a Hugging Face `generate()` loop runs it: each batch's prefill in
    one pass, then a key/value cache that grows by concatenation at every token.

    Stands for a 1B decoder (Llama-3.2-1B's shape, bf16) generating for batches of 4 to 32
    prompts (lengths log-normal around `prompt_median` tokens, 64 to 3,500; each row wants up
    to `max_new` new tokens, and the batch runs until its longest is done). The prefill runs
    the whole batch through each layer and keeps that layer's K and V (tens to hundreds of
    MiB, never whole pages) between temporaries of up to 3 GiB (the MLP's gate and up
    projections over every token of the batch), which later layers' K and V land in once
    freed; then each decoding step allocates every layer's K and V anew one token longer
    (torch.cat) and frees the old ones, the input IDs and attention mask likewise, and draws
    the next tokens from the fp32 logits (top-p).

    batches: generate() calls (--scale multiplies it); the model: layers, hidden, kv_heads,
    head_dim, intermediate, vocab; prompt_median; max_new: the most new tokens a row wants.

    Defaults: 79,523 events, peak live 9.393 GiB with seed 0 (6 to 11 GiB over seeds).
    """
    rng = random.Random(seed)
    kv_dim = kv_heads * head_dim
    _llm_weights(rec, layers, hidden, kv_dim, intermediate, vocab)
    for _ in range(batches):
        batch = rng.choice([4, 8, 8, 16, 16, 24, 32])
        prompt = _lognormal_int(rng, prompt_median, 0.6, 64, 3500)
        new = max(_lognormal_int(rng, max_new // 2, 0.7, 2, max_new) for _ in range(batch))
        ids, mask = rec.alloc(batch * prompt * 8), rec.alloc(batch * prompt * 8)
        t = batch * prompt
        x = rec.alloc(t * hidden * 2)
        cache = []
        for _ in range(layers):
            n = _rms_norm(rec, t, hidden)
            q, k, v = _qkv(rec, t, hidden, kv_dim)
            rec.free(n)
            cache += [k, v]
            o = rec.alloc(t * hidden * 2)
            rec.free(q)
            x2 = rec.alloc(t * hidden * 2)
            rec.free_all((o, x))
            n2 = _rms_norm(rec, t, hidden)
            gate_up = rec.alloc(t * 2 * intermediate * 2)
            rec.free(n2)
            act = rec.alloc(t * intermediate * 2)
            rec.free(gate_up)
            d = rec.alloc(t * hidden * 2)
            rec.free(act)
            x = rec.alloc(t * hidden * 2)
            rec.free_all((d, x2))
        last = rec.alloc(batch * hidden * 2)
        rec.free(x)
        tokens = _sample(rec, batch, vocab)
        rec.free(last)
        length = prompt + 1
        for _ in range(1, new):
            grown = rec.alloc(batch * length * 8)
            rec.free(mask)
            mask = grown
            grown = rec.alloc(batch * length * 8)
            rec.free(ids)
            ids = grown
            x = rec.alloc(batch * hidden * 2)
            for layer in range(layers):
                n = _rms_norm(rec, batch, hidden)
                q, k, v = _qkv(rec, batch, hidden, kv_dim)
                rec.free(n)
                for i, new_kv in ((2 * layer, k), (2 * layer + 1, v)):
                    longer = rec.alloc(batch * length * kv_dim * 2)
                    rec.free_all((cache[i], new_kv))
                    cache[i] = longer
                o = rec.alloc(batch * hidden * 2)
                rec.free(q)
                x2 = rec.alloc(batch * hidden * 2)
                rec.free_all((o, x))
                gate_up = rec.alloc(batch * 2 * intermediate * 2)
                act = rec.alloc(batch * intermediate * 2)
                rec.free(gate_up)
                x = rec.alloc(batch * hidden * 2)
                rec.free_all((act, x2))
            drawn = _sample(rec, batch, vocab)
            rec.free_all((tokens, x))
            tokens = drawn
            length += 1
        rec.free_all(cache)
        rec.free_all((ids, mask, tokens))


@workload(length="steps")
def mixed_lifetimes(rec, seed, *, steps=230, small_per_step=200, small_min=64 * KIB,
                    small_max=MIB, live_small=3000, workspace_rate=0.02,
                    workspace_min=256 * MIB, workspace_max=2 * GIB, live_workspaces=4):
    """Many long-lived tensors of 64 KiB-1 MiB among a few huge short-lived workspaces.

    Stands for a model with many small parameter-like tensors that come and go slowly (a
    detection or graph model's buffers, per-request state of a server) beside the large
    scratch buffers of its operators. Each step allocates `small_per_step` tensors of
    log-uniform size between `small_min` and `small_max` (either side of the small arena's
    limit); once `live_small` are live, each new one frees one of them chosen at random.
    With probability `workspace_rate` per tensor a workspace of uniform size between
    `workspace_min` and `workspace_max` is allocated too, and once `live_workspaces` are live
    one of them, at random, is freed.

    steps: how many steps (--scale multiplies it).

    Defaults: 93,836 events, peak live 9.912 GiB with seed 0 (9 to 11 GiB over seeds).
    """
    rng = random.Random(seed)
    lo, hi = math.log(small_min), math.log(small_max)
    small, workspaces = [], []
    for _ in range(steps):
        for _ in range(small_per_step):
            small.append(rec.alloc(int(math.exp(rng.uniform(lo, hi)))))
            if len(small) > live_small:
                rec.free(_take_at_random(rng, small))
            if rng.random() < workspace_rate:
                workspaces.append(rec.alloc(rng.randint(workspace_min, workspace_max)))
                if len(workspaces) > live_workspaces:
                    rec.free(workspaces.pop(rng.randrange(len(workspaces))))
    rec.free_all(small)
    rec.free_all(workspaces)


@workload(length="steps")
def off_page_sizes(rec, seed, *, steps=40000, live=300, unit=2 * MIB, max_units=16,
                   offsets=(4 * KIB, 512, 1, -4 * KIB, 0)):
    """Tensors whose sizes fall just off a multiple of 2 MiB, replaced at random.

    Stands for tensors whose shapes are round numbers plus a little (a vocabulary of 50,257,
    a padded sequence, a bias folded into a weight): k * `unit` + an offset, k uniform in
    1..`max_units`, the offset drawn from `offsets`. `live` of them are live; each step
    allocates one and frees one chosen at random. A block just past a page boundary shares
    its last page with whatever goes beside it.

    steps: how many allocations (--scale multiplies it).

    Defaults: 80,000 events, peak live 5.424 GiB with seed 0 (5 to 6 GiB over seeds).
    """
    rng = random.Random(seed)
    blocks = []
    for _ in range(steps):
        blocks.append(rec.alloc(rng.randint(1, max_units) * unit + rng.choice(offsets)))
        if len(blocks) > live:
            rec.free(_take_at_random(rng, blocks))
    rec.free_all(blocks)


def _take_at_random(rng, items):
    """Removes an item of `items` chosen at random and returns it (the last takes its place)."""
    i = rng.randrange(len(items))
    items[i], items[-1] = items[-1], items[i]
    return items.pop()


def _log_uniform_int(rng, lo, hi):
    """A size drawn log-uniformly between `lo` and `hi` bytes."""
    return int(math.exp(rng.uniform(math.log(lo), math.log(hi))))


@workload(length="steps")
def huge_buffers(rec, seed, *, steps=12000, live=7, min_gib=0.9, max_gib=2.6,
                 exact_fraction=0.25,
                 exact_sizes=(GIB + 1, GIB + 4 * KIB, 2 * GIB - 4 * KIB, GIB + 2 * MIB + 512,
                              GIB),
                 mid_live=40, mid_min=4 * MIB, mid_max=96 * MIB, max_temps=2,
                 temp_min=MIB, temp_max=300 * MIB, max_live_gib=20.0):
    """A few buffers of 0.9 to 2.6 GiB each, replaced at random, among mid-size tensors.

    Stands for a program whose largest tensors are each a large share of the GPU and change
    length from one use to the next: fp32 logits over a long sequence and a large vocabulary
    (2,048 tokens of a 128k vocabulary are about 1 GiB), outputs gathered from every rank, a
    model's state gathered whole for a checkpoint. `live` such buffers are live; each step
    allocates one and frees one of them chosen at random. Its size is uniform between
    `min_gib` and `max_gib` GiB, or, for a fraction `exact_fraction` of them, one of
    `exact_sizes`: exactly 1 GiB, or just past or short of 1 or 2 GiB. Beside them, each step
    allocates 0 to 2 tensors of `mid_min` to `mid_max` bytes (log-uniform) into a set of
    `mid_live` replaced at random, and 0 to `max_temps` temporaries of `temp_min` to
    `temp_max` bytes (log-uniform) freed at once. A huge buffer is allocated before the one it
    replaces is freed, unless that would take the live bytes over `max_live_gib` GiB: then the
    old one goes first (as a program short of memory drops the old logits before computing
    the new ones).

    steps: how many huge buffers are allocated (--scale multiplies it).

    Defaults: 71,864 events, peak live 18.990 GiB with seed 0 (18 to 20 GiB over seeds).
    """
    rng = random.Random(seed)
    big, mid = [], []
    cap = int(max_live_gib * GIB)
    size_of = {}
    live_bytes = 0

    def alloc(nbytes, into):
        nonlocal live_bytes
        ident = rec.alloc(nbytes)
        size_of[ident] = nbytes
        live_bytes += nbytes
        into.append(ident)

    def free(ident):
        nonlocal live_bytes
        rec.free(ident)
        live_bytes -= size_of.pop(ident)

    for _ in range(steps):
        if rng.random() < exact_fraction:
            nbytes = rng.choice(exact_sizes)
        else:
            nbytes = rng.randint(int(min_gib * GIB), int(max_gib * GIB))
        if len(big) >= live and live_bytes + nbytes > cap:
            # Over the limit: the one replaced goes first.
            free(_take_at_random(rng, big))
        alloc(nbytes, big)
        if len(big) > live:
            free(_take_at_random(rng, big))
        for _ in range(rng.randint(0, 2)):
            alloc(_log_uniform_int(rng, mid_min, mid_max), mid)
            if len(mid) > mid_live:
                free(mid.pop(rng.randrange(len(mid))))
        for _ in range(rng.randint(0, max_temps)):
            rec.free(rec.alloc(_log_uniform_int(rng, temp_min, temp_max)))
    rec.free_all(big)
    rec.free_all(mid)


@workload(length="steps")
def phase_change(rec, seed, *, steps=32000, switch=0.6875, small_min=512, small_max=4 * MIB,
                 small_live_gib=4.0, free_rate=0.3, keep_fraction=0.03, large_min=128 * MIB,
                 large_max=1536 * MIB, large_live=16, max_temps=2, temp_max=256 * KIB):
    """A phase of small-tensor churn whose few survivors stay, then one of large tensors.

    Stands for a job that first prepares its data on the GPU and then runs a dense model on
    it: tokenisation, feature extraction or a graph network's sparse operators make many
    small and medium tensors, a few of which are kept for the rest of the run (cached
    features, per-sample metadata), then the model's large activations take over. In the
    first phase (a fraction `switch` of the steps) each step allocates a tensor of
    `small_min` to `small_max` bytes (log-uniform); with probability `free_rate`, or always
    when the live bytes exceed `small_live_gib` GiB, one live tensor chosen at random is freed.
    At the change every live tensor is freed except a fraction `keep_fraction` of them,
    chosen at random, which stay to the end. In the second phase each step allocates a
    tensor of `large_min` to `large_max` bytes (log-uniform) and 0 to `max_temps` temporaries
    of 512 bytes to `temp_max` (log-uniform) freed at once; once `large_live` large tensors
    are live, each new one frees one of them chosen at random.

    steps: both phases' allocations together (--scale multiplies it); switch: the part of
    them in the first phase.

    Defaults: 84,012 events, peak live 16.310 GiB with seed 0 (14 to 18 GiB over seeds).
    """
    rng = random.Random(seed)
    small_steps = int(round(steps * switch))
    cap = int(small_live_gib * GIB)
    live, size_of = [], {}
    live_bytes = 0
    for _ in range(small_steps):
        nbytes = _log_uniform_int(rng, small_min, small_max)
        ident = rec.alloc(nbytes)
        live.append(ident)
        size_of[ident] = nbytes
        live_bytes += nbytes
        if live_bytes > cap or rng.random() < free_rate:
            ident = _take_at_random(rng, live)
            rec.free(ident)
            live_bytes -= size_of.pop(ident)
    kept = []
    rng.shuffle(live)
    for ident in live:
        if rng.random() < keep_fraction:
            kept.append(ident)
        else:
            rec.free(ident)
    large = []
    for _ in range(steps - small_steps):
        large.append(rec.alloc(_log_uniform_int(rng, large_min, large_max)))
        for _ in range(rng.randint(0, max_temps)):
            rec.free(rec.alloc(_log_uniform_int(rng, 512, temp_max)))
        if len(large) > large_live:
            rec.free(_take_at_random(rng, large))
    rec.free_all(large)
    rec.free_all(kept)


@workload(length="steps")
def small_tensor_churn(rec, seed, *, steps=44000, min_bytes=64 * KIB, max_bytes=256 * KIB,
                       live_high=20000, live_low=20000, wave=16000):
    """Tens of thousands of live tensors of 64-256 KiB, replaced at random.

    Stands for a program that holds a great many small tensors at once and keeps replacing
    them: the per-parameter states of a model with thousands of small parameters (norms,
    biases, embeddings of small tables), per-sample metadata, a graph network's index lists.
    Sizes are log-uniform between `min_bytes` and `max_bytes` (by default all within the
    small arena, 256 KiB). The live count first grows to its target, then each step flips a
    coin to allocate and another to free one live tensor chosen at random, allocating when
    under the target and freeing when over it. The target is `live_high` (about 2.6 GiB at
    the defaults); with `live_low` below it, the target alternates between the two every
    `wave` steps, starting low.

    steps: how many steps (--scale multiplies it); live_high, live_low, wave: the live count
    aimed at and how often it changes.

    Defaults: 85,308 events, peak live 2.642 GiB with seed 0 (2.6 to 2.7 GiB over seeds).
    """
    rng = random.Random(seed)
    live = []
    target = live_high
    for step in range(steps):
        if step % wave == 0:
            target = live_high if target == live_low else live_low
        if len(live) < target or rng.random() < 0.5:
            live.append(rec.alloc(_log_uniform_int(rng, min_bytes, max_bytes)))
        if len(live) > target or (rng.random() < 0.5 and live):
            rec.free(_take_at_random(rng, live))
    rec.free_all(live)


@workload(length="steps")
def off_page_multiples(rec, seed, *, steps=42000, live=260, units=(4 * MIB, 8 * MIB, 20 * MIB),
                       max_units=(16, 10, 5),
                       remainders=(512, 4 * KIB, 64 * KIB, MIB, 2 * MIB + 512, 1)):
    """Tensors of k x 4, 8 or 20 MiB plus a small odd remainder, replaced at random.

    Stands for large tensors whose shapes are round in one dimension and a little over in
    another: a batch times a hidden size with an extra row or a padded token, a vocabulary
    padded to a multiple of 64 with a few special tokens more, a bias or a scale stored with
    a weight. Each size is k times a unit plus a remainder: the unit one of `units` (4 MiB,
    the pool's page, 8 MiB and 20 MiB), chosen evenly, k uniform in 1 up to that unit's entry
    of `max_units`, the remainder one of `remainders` (1 B, 512 B, 4 KiB, 64 KiB, 1 MiB,
    2 MiB + 512 B). `live` tensors are live; each step allocates one and frees one chosen at
    random. Unlike off_page_sizes the sizes reach 102 MiB and the remainders just over half
    a 4 MiB page, so a block rarely fits the hole that a freed one leaves.

    steps: how many allocations (--scale multiplies it); units and max_units: the units and
    the most of each.

    Defaults: 84,000 events, peak live 13.438 GiB with seed 0 (12 to 14 GiB over seeds).
    """
    rng = random.Random(seed)
    if len(units) != len(max_units):
        raise ValueError(f"{len(units)} units but {len(max_units)} max_units")
    kinds = list(zip(units, max_units))
    blocks = []
    for _ in range(steps):
        unit, most = rng.choice(kinds)
        blocks.append(rec.alloc(rng.randint(1, most) * unit + rng.choice(remainders)))
        if len(blocks) > live:
            rec.free(_take_at_random(rng, blocks))
    rec.free_all(blocks)


# ---------------------------------------------------------------------------------------------
# Running and checking.


def run(name, sink, seed=0, scale=1.0, overrides=None):
    """Emits the events of workload `name` through `sink(op, ident, nbytes)`."""
    w = WORKLOADS[name]
    w.fn(Recorder(sink), seed, **w.params(scale, overrides))


def events(name, seed=0, scale=1.0, overrides=None):
    """The events of workload `name` as a list of (op, ident, nbytes)."""
    out = []
    run(name, lambda op, ident, nbytes: out.append((op, ident, nbytes)), seed, scale, overrides)
    return out


class Stats:
    """A sink that checks the events as they come (IDs allocated once, freed at most once and
    only when live, sizes positive) and keeps counts and peak live bytes."""

    def __init__(self):
        self.events = 0
        self.allocs = 0
        self.frees = 0
        self.live_bytes = 0
        self.peak_live_bytes = 0
        self.max_alloc = 0
        self.live = {}      # ID -> bytes
        self.seen = set()   # every ID ever allocated

    def __call__(self, op, ident, nbytes):
        self.events += 1
        if op == "a":
            if ident in self.seen:
                raise ValueError(f"event {self.events}: ID {ident} allocated twice")
            if not isinstance(nbytes, int) or nbytes <= 0:
                raise ValueError(f"event {self.events}: ID {ident} of {nbytes!r} bytes")
            self.seen.add(ident)
            self.live[ident] = nbytes
            self.allocs += 1
            self.live_bytes += nbytes
            self.peak_live_bytes = max(self.peak_live_bytes, self.live_bytes)
            self.max_alloc = max(self.max_alloc, nbytes)
        elif op == "f":
            if ident not in self.live:
                why = "freed twice" if ident in self.seen else "never allocated"
                raise ValueError(f"event {self.events}: free of ID {ident}, {why}")
            self.live_bytes -= self.live.pop(ident)
            self.frees += 1
        else:
            raise ValueError(f"event {self.events}: unknown op {op!r}")


def write(name, out, seed=0, scale=1.0, overrides=None):
    """Writes the trace to the text stream `out`."""
    buf = []

    def sink(op, ident, nbytes):
        buf.append(f"a {ident} {nbytes}\n" if op == "a" else f"f {ident}\n")
        if len(buf) >= 8192:
            out.write("".join(buf))
            buf.clear()

    run(name, sink, seed, scale, overrides)
    out.write("".join(buf))


def _parse_value(default, text):
    if isinstance(default, bool):
        return text.lower() in ("1", "true", "yes")
    if isinstance(default, int):
        return int(text)
    if isinstance(default, float):
        return float(text)
    if isinstance(default, tuple):
        return tuple(int(v) for v in text.split(",") if v)
    return text


def main(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="workloads: " + ", ".join(WORKLOADS))
    p.add_argument("name", nargs="?", help="the workload (--list shows them)")
    p.add_argument("--list", action="store_true", help="list the workloads and exit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies the trace's length (default 1)")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="overrides a parameter of the workload (repeatable)")
    p.add_argument("--stats", action="store_true",
                   help="print events, allocations and peak live bytes instead of the trace")
    a = p.parse_args(argv)
    if a.list:
        width = max(len(n) for n in WORKLOADS)
        for name, w in WORKLOADS.items():
            print(f"{name:<{width}}  {w.events:>6} events  peak {w.peak_gib_seed0:6.3f} GiB  "
                  f"{w.summary}")
        return 0
    if a.name not in WORKLOADS:
        p.error(f"unknown workload {a.name!r}; one of: {', '.join(WORKLOADS)}")
    if a.scale <= 0:
        p.error("--scale must be positive")
    w = WORKLOADS[a.name]
    overrides = {}
    for item in a.set:
        key, eq, text = item.partition("=")
        if not eq or key not in w.defaults:
            p.error(f"--set {item}: {a.name}'s parameters are {', '.join(w.defaults)}")
        overrides[key] = _parse_value(w.defaults[key], text)
    if a.stats:
        s = Stats()
        run(a.name, s, a.seed, a.scale, overrides)
        print(f"{a.name}: {s.events} events, {s.allocs} allocations, {s.frees} frees, "
              f"peak live {s.peak_live_bytes} bytes ({s.peak_live_bytes / GIB:.3f} GiB), "
              f"largest {s.max_alloc / MIB:.1f} MiB, {len(s.live)} live at the end")
        return 0
    write(a.name, sys.stdout, a.seed, a.scale, overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
