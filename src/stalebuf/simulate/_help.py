"""The simulator's own account of itself, as ``stalebuf simulate --help`` prints it: the model
(:data:`DESCRIPTION`, :data:`MODEL_HELP`) and the help of each option (:data:`FIELD_OPTIONS`),
kept beside the code it describes."""

from __future__ import annotations

from ._bounds import (
    MAX_BATCH_SIZE,
    MAX_CHUNK_TOKENS,
    MAX_FILE_BYTES,
    MAX_GROUP_SIZE,
    MAX_STEP_TRAJECTORIES,
    MAX_TOKENS_PER_SECOND,
    MAX_TRAJECTORY_TOKENS,
    MAX_WORKERS,
    MIN_FILTER_PASS_RATE,
)

__all__ = ["DESCRIPTION", "FIELD_OPTIONS", "MODEL_HELP"]

#: The ``simulate`` option of each SimulationConfig field, in ``--help`` order, as its
#: ``(metavar, help)``: the flag is the field's name with dashes, and its default and type are the
#: field's. A new field needs one line here. ``strategy``, ``admission``, ``batch_by`` and
#: ``in_flight_updates`` have no entry: ``--strategy``, ``--admission`` and the
#: ``--in-flight-updates`` flag and ``--batch-by`` choose which configs run.
FIELD_OPTIONS: dict[str, tuple[str | None, str]] = {
    "threshold": ("T", "max_off_policy_threshold"),
    "parameter_sync_step": ("S", "parameter_sync_step"),
    "steps": ("N", "trainer steps to simulate"),
    "batch_size": (
        "B",
        f"groups per trainer step, at most {MAX_BATCH_SIZE} (the simulator keeps a record of every "
        "prompt it dispatches, and a few KB per group in flight)",
    ),
    "group_size": (
        "N",
        f"trajectories per group (GRPO n), at most {MAX_GROUP_SIZE}, and batch-size * group-size at "
        f"most {MAX_STEP_TRAJECTORIES} (each trajectory in flight takes about 200 B of memory)",
    ),
    "workers": (
        "W",
        f"rollout workers, one group at a time each, at most {MAX_WORKERS} (each is a task of about 10 KB)",
    ),
    "dispatch_ahead": (
        "K",
        "without admission: prompts dispatched beyond the batch being filled, in batches",
    ),
    "latency": (
        "SPEC",
        "generation time per group in seconds: lognormal:MU,SIGMA (of ln seconds), "
        "lognormal-fit:MEDIAN,P95 (seconds), exponential:MEAN, fixed:SECONDS, or "
        "empirical:PATH[#COLUMN] (times read from a file and resampled with --seed; see below)",
    ),
    "train_step_seconds": ("SECONDS", "time one trainer step takes once it has its batch"),
    "failure_rate": ("P", "probability that a group's generation fails"),
    "failure_strategy": (None, "evict failed groups (and dispatch replacements) or train on them"),
    "filter_pass_rate": (
        "P",
        "probability that a finished group passes the buffer's zero_variance filter (drawn per prompt "
        "with --seed): below 1 the buffer is built with filters=[zero_variance('score')] and a group's "
        "trajectories score all the same with probability 1 - P, so it is filtered as it finishes and "
        f"frees its admission slot; at least {MIN_FILTER_PASS_RATE:g}, with group-size at least 2",
    ),
    "tasks": (
        "SPECS",
        "a mixed run: NAME:WEIGHT[:LATENCY] entries separated by ';', e.g. "
        "'math:0.5:lognormal:3.4,1;code:0.5:lognormal:4.0,1.2' (LATENCY as for --latency, which a "
        "task without one takes); the weights are the buffer's SamplerConfig.mixture (tag 'task'), "
        "and the report adds each task's trained share and staleness",
    ),
    "mixture_policy": (
        None,
        "with --tasks: the buffer's mixture_policy, wait (every batch waits for each task's quota) or "
        "borrow (a short task's quota is filled from the others, and paid back)",
    ),
    "seed": ("N", "random seed"),
    "tokens_per_second": (
        "TPS",
        "with --in-flight-updates or --token-budget: decoding speed of one trajectory; a group's "
        f"longest trajectory has generation-time * TPS tokens (at most {MAX_TRAJECTORY_TOKENS}), "
        f"TPS at most {MAX_TOKENS_PER_SECOND:g}",
    ),
    "chunk_tokens": (
        "N",
        "with --in-flight-updates: tokens a worker decodes between two looks at the weights version, "
        f"at most {MAX_CHUNK_TOKENS}",
    ),
    "token_budget": (
        "K",
        "count tokens: every trajectory is put with tokens= (prompt-tokens + its response's), and the "
        "trainer samples by tokens, sample(g, token_budget=K), with admission counting tokens "
        "(admission_token_budget=K, max_tokens_per_group=group-size*(prompt-tokens+max-response-tokens)); "
        "the report adds the tokens of each step (see below)",
    ),
    "prompt_tokens": ("N", "with --token-budget: the prompt's tokens in every trajectory"),
    "max_response_tokens": (
        "N",
        "with --token-budget: the longest response (the engine's max_tokens): a longer one is cut there",
    ),
}

#: What ``stalebuf simulate`` does, in a few lines.
DESCRIPTION = (
    "Run the real ReplayBuffer inside a simulated asynchronous GRPO pipeline (a trainer\n"
    "and rollout workers) on a virtual clock, and compare the drop and wait strategies,\n"
    "with and without admission control: throughput, trainer idle time, wasted rollouts,\n"
    "staleness and length bias. With --in-flight-updates, new weights reach the workers\n"
    "mid-generation, trajectories carry the version of each chunk, and drop, wait and mask\n"
    "are compared token by token."
)

#: The model and how to read the report, after the options (line breaks kept).
MODEL_HELP = f"""\
the model:
  Each step the trainer calls sample(g, batch-size) on the real ReplayBuffer
  (idle time) and trains for train-step-seconds (busy time). Each prompt's
  generation time (its "length") is drawn from --latency; a worker puts
  group-size trajectories and marks the group finished, or fails it part-way
  with probability --failure-rate. Time is virtual (trio's MockClock); a seed
  reproduces a run.

  Without admission, the trainer keeps batch-size * (1 + dispatch-ahead)
  prompts dispatched (taken from the dataset, not yet trained or evicted): after
  each sample it dispatches as many new prompts tagged with step g, and groups
  the buffer evicts (stale under drop, failed under --failure-strategy evict)
  are replaced from on_evict. Workers take prompts in dispatch order.

  With admission (the buffer's admission_batch_size = batch-size), each worker
  loops "async with buffer.rollout(uid)": it waits until the buffer admits a
  group (at most batch-size groups per dispatch step, T*S*batch-size resident)
  and generates it. Under drop the buffer also evicts groups that turned stale
  in flight (evict_stale_in_flight), which cancels their rollout at once.

filters and task mixtures:
  --filter-pass-rate P builds the buffer with filters=[zero_variance('score')]:
  each prompt draws at dispatch (with --seed) whether its trajectories score
  all the same (probability 1 - P), and then its group is filtered as it
  finishes: evicted at once, its admission slot refunded (without admission,
  replaced from on_evict). The report adds steps per hour, the share filtered
  and the pass rate observed.
  --tasks 'math:0.5:lognormal:3.4,1;code:0.5:lognormal:4.0,1.2' is a mixed run:
  the weights are the buffer's SamplerConfig.mixture, each group is tagged
  task=NAME and draws its generation time from its task's latency (or
  --latency). Without admission each task keeps its share of the dispatched
  prompts; with admission the workers are split among the tasks by the same
  quotas. --mixture-policy wait|borrow is the buffer's mixture_policy. The
  report adds each task's trained share (against its quota of a batch) and
  max staleness.

empirical latencies:
  --latency empirical:PATH reads one number of seconds per line (blank lines
  skipped), or a JSON array of numbers if PATH ends in .json.
  --latency empirical:PATH#COLUMN reads that column of a CSV file with a
  header row, or that field of a .json file (an array of objects or an object
  of arrays) or of a .jsonl/.ndjson file (one object per line). Every value
  must be a number > 0 and at most 1e12. Each prompt's time is drawn from
  them uniformly, with --seed. PATH must be a regular file (not a FIFO or a
  device) of at most {MAX_FILE_BYTES // 2**20} MiB. A file that cannot be read is one error line
  and exit status 2.

reading the report:
  "long prompts" are the slowest quarter of the first steps * batch-size
  dispatched prompts: every run dispatches those, with the same lengths for a
  seed, so "long" is the same in every column, whichever --strategy and
  --admission run. "vs dispatched" is the share of long prompts among trained
  groups over their share among those prompts: below 1.00x, the strategy
  under-trains long, hard prompts.

token budgets (--token-budget K):
  Every trajectory is put with tokens=: --prompt-tokens plus its response's
  tokens. A group's longest response has generation-time * --tokens-per-second
  tokens, its others 25-100% of that (drawn with --seed), each cut at
  --max-response-tokens (the engine's max_tokens; the generation time is not
  cut), so a group has at most M = group-size * (prompt-tokens +
  max-response-tokens) tokens, whatever the latency. The trainer calls
  sample(g, token_budget=K); with admission the buffer counts tokens
  (admission_token_budget=K, max_tokens_per_group=M, so K must be at least
  M); without it, the trainer keeps prompts of K * (1 + dispatch-ahead) tokens
  dispatched. --batch-by groups keeps batches of batch-size groups and only
  counts their tokens; --batch-by both runs both side by side. The report adds
  the trainer's tokens per step (mean and coefficient of variation), the fill
  (tokens / K), the most tokens resident and the share of groups cut. Not
  with --tasks or --in-flight-updates.

in-flight weight updates (--in-flight-updates):
  After each train step that ends at a sync point (every step at S=1) the
  trainer pushes the new weights, version g+1, to the workers, which take them
  mid-generation. A worker marks its group running at the version it starts
  on and decodes its trajectories in chunks of --chunk-tokens, each chunk by
  the version served when it starts; the group's longest trajectory has
  generation-time * --tokens-per-second tokens, the others from a quarter of
  that to as many, so they finish earlier. Each trajectory is put with the
  versions of its chunks. The runs are drop, wait and mask, with admission
  (--strategy and --admission choose others). The report counts tokens: a
  token of version v sampled at step g has lag g - v + 1 and is fresh iff
  lag <= T*S. Trained tokens are those in the loss (every returned token under
  drop and wait, the fresh ones under mask); masked ones are returned and kept
  out of the loss; thrown-away ones never reach the trainer (evicted groups,
  unfinished trajectories of failed ones). "trained groups stale by p, fresh
  by head" are the groups that measuring from the dispatch step p instead of
  the oldest token would have dropped: none unless groups start on newer
  weights than p (prompts queued for a worker, without admission).
"""
