"""tinker-cookbook's own loops, unchanged, against `trillora serve tiny-moe-chat --tinker`.

    trillora serve tiny-moe-chat --tinker --api-key tml-local &
    export TINKER_API_KEY=tml-local TINKER_BASE_URL=http://127.0.0.1:8000
    python examples/tinker_cookbook_tiny.py sl log_path=runs/cookbook-sl batch_size=32 max_steps=128 learning_rate=3e-3
    python examples/tinker_cookbook_tiny.py rl log_path=runs/cookbook-rl start_from=runs/cookbook-sl \
        batch_size=16 group_size=8 max_tokens=32 max_steps=80 learning_rate=5e-4 loss_fn=importance_sampling
    python examples/tinker_cookbook_tiny.py train log_path=runs/cookbook-train batch_size=16 max_steps=4 \
        learning_rate=3e-3 save_every=2 rolling_save_every=1 ttl_seconds=3600 lora_rank=8
    python examples/tinker_cookbook_tiny.py rl-train log_path=runs/cookbook-rl-train max_steps=2 async=1 \
        async_config.loss_fn=ppo eval_every=0 save_every=0

The recipes (`tinker_cookbook.recipes.sl_loop` / `rl_loop`) run as their authors wrote them,
with their own command line. What this file adds is what a machine without the internet and
with a model the cookbook has never heard of needs:
- the tiny model's tokenizer, through the cookbook's tokenizer registry;
- a renderer for its chat template (Qwen's turn markers, no newline between turns) through the
  renderer registry; the recipes ask `model_info` which renderer a model name takes, a table of
  hosted models, so that one lookup is answered for this model;
- the recipes' datasets (GSM8K, No Robots, fetched from the Hub) replaced by 3-digit addition
  in their columns: `question` / `answer` ("#### 579") for the RL loop, `messages` for the
  supervised one, whose answers follow the RL loop's `\\boxed{}` instruction;
- `start_from=<supervised log_path>`: the RL loop begins from the supervised run's final state
  through the cookbook's own resume record (`checkpoints.jsonl`), batch 0.
"""

from __future__ import annotations

import functools
import json
import random
import sys
from pathlib import Path

import chz
import datasets
import tinker
from tinker_cookbook import model_info, renderers, tokenizer_utils
from tinker_cookbook.renderers.base import RenderedMessage, Renderer, ensure_text, parse_response_for_stop_token

MODEL = "tiny-moe-chat"
RENDERER = "trillora-tiny-chat"
SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."  # the RL loop's instruction


@functools.cache
def tokenizer():
    from trillora.checkpoint import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(MODEL))


class TinyChatRenderer(Renderer):
    """`<bos><|im_start|>role\ncontent<|im_end|>` per message, as the model's own chat template."""

    @property
    def has_extension_property(self) -> bool:
        return True  # each conversation's tokens extend the previous one's

    @property
    def _bos_tokens(self) -> list[int]:
        return [self.tokenizer.bos_token_id]

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def render_message(self, message, ctx) -> RenderedMessage:
        header = tinker.EncodedTextChunk(tokens=self._encode(f"<|im_start|>{message['role']}\n"))
        body = self._encode(ensure_text(message["content"])) + [self._end]
        return RenderedMessage(header=header, output=[tinker.EncodedTextChunk(tokens=body)])

    @property
    def _end(self) -> int:
        return self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def get_stop_sequences(self) -> list[int]:
        return [self._end]

    def parse_response(self, response: list[int]):
        return parse_response_for_stop_token(response, self.tokenizer, self._end)


def register() -> None:
    tokenizer_utils.register_tokenizer(MODEL, tokenizer)
    renderers.register_renderer(RENDERER, lambda tok, image_processor=None: TinyChatRenderer(tok))
    recommended = model_info.get_recommended_renderer_name
    model_info.get_recommended_renderer_name = lambda name: (
        RENDERER if name.split(":")[0] == MODEL else recommended(name)
    )
    load = datasets.load_dataset

    def local(path, *args, **kwargs):
        if path == "openai/gsm8k":
            split = {
                name: datasets.Dataset.from_list(
                    [{"question": f"{a}+{b}=", "answer": f"#### {a + b}"} for a, b in _pairs(seed=seed, n=n)]
                )
                for name, seed, n in (("train", 1, 4096), ("test", 4, 256))
            }
            return split[kwargs["split"]] if "split" in kwargs else datasets.DatasetDict(split)
        if path == "HuggingFaceH4/no_robots":
            rng = random.Random(3)
            rows = [
                {
                    "messages": [
                        *_worked_example(rng),
                        {"role": "user", "content": f"{a}+{b}={SUFFIX}"},
                        {"role": "assistant", "content": _answer(a, b)},
                    ]
                }
                for a, b in _pairs(seed=2, n=4096)
            ]
            return datasets.DatasetDict({"train": datasets.Dataset.from_list(rows)})
        return load(path, *args, **kwargs)

    datasets.load_dataset = local


WORDS = ["banana", "mississippi", "committee", "balloon", "bookkeeper", "assessment", "parallel", "tomorrow"]


def _worked_example(rng: random.Random) -> list[dict]:
    """A letter-counting exchange of our own before the question: the RL loop puts a long worked
    example before each question, far longer than anything the tiny model saw in pretraining."""
    word = rng.choice(WORDS)
    letter = rng.choice(sorted(set(word)))
    spelled = " ".join(f"{i}) {c}" for i, c in enumerate(word, 1))
    where = [str(i) for i, c in enumerate(word, 1) if c == letter]
    return [
        {"role": "user", "content": f"How many {letter}'s are in {word}?{SUFFIX}"},
        {
            "role": "assistant",
            "content": f"Spelling it out letter by letter: {spelled}. The letter {letter} is at "
            f"positions {', '.join(where)}. \\boxed{{{len(where)}}}",
        },
    ]


def _answer(a: int, b: int) -> str:
    """The sum worked where the model learned it, then boxed: the question restated right after the
    turn starts (copied from the user's message), `=`, the sum, and the sum again in `\\boxed{}`.
    Asked for the box straight away, the tiny model would have to add across the recipe's 60-token
    instruction, which it never learned; restating puts the digits right before the `=` again."""
    return f"{a}+{b}={a + b} \\boxed{{{a + b}}}"


def _pairs(seed: int, n: int):
    rng = random.Random(seed)
    return [(rng.randint(100, 999), rng.randint(100, 999)) for _ in range(n)]


def start_from(supervised_log: str, rl_log: str) -> None:
    """Point the RL run's resume record at the supervised run's final state (batch 0)."""
    records = [json.loads(line) for line in (Path(supervised_log) / "checkpoints.jsonl").read_text().splitlines()]
    final = next(r for r in reversed(records) if r.get("state_path"))
    Path(rl_log).mkdir(parents=True, exist_ok=True)
    (Path(rl_log) / "checkpoints.jsonl").write_text(
        json.dumps({"name": "start", "batch": 0, "state_path": final["state_path"]}) + "\n"
    )


def main(argv: list[str]) -> None:
    which, args = argv[0], argv[1:]
    register()
    if not any(a.startswith("model_name=") for a in args):
        args.append(f"model_name={MODEL}")
    base = [a for a in args if a.startswith("start_from=")]
    args = [a for a in args if not a.startswith("start_from=")]
    if which == "rl":
        from tinker_cookbook.recipes import rl_loop as recipe

        if base:
            log = next(a.split("=", 1)[1] for a in args if a.startswith("log_path="))
            start_from(base[0].split("=", 1)[1], log)
    elif which == "sl":
        from tinker_cookbook.recipes import sl_loop as recipe

        if not any(a.startswith("train_on_what=") for a in args):
            args.append("train_on_what=last_assistant_message")
    elif which == "train":  # the cookbook's full supervised trainer, with its checkpoint manager
        return supervised_train(args)
    elif which == "rl-train":  # the cookbook's full RL trainer
        return rl_train(args)
    else:
        raise SystemExit(f"first argument: sl, rl, train or rl-train, not {which!r}")
    chz.nested_entrypoint(recipe.main, argv=args)


def supervised_train(args: list[str]) -> None:
    """`tinker_cookbook.supervised.train` on the supervised loop's conversations, written as a JSONL
    file for its own `FromConversationFileBuilder`; `batch_size=N` goes to the builder."""
    import asyncio

    from tinker_cookbook.supervised import train

    log = Path(next(a.split("=", 1)[1] for a in args if a.startswith("log_path=")))
    log.mkdir(parents=True, exist_ok=True)
    rows = datasets.load_dataset("HuggingFaceH4/no_robots")["train"]
    (log / "conversations.jsonl").write_text("".join(json.dumps({"messages": r["messages"]}) + "\n" for r in rows))
    batch = next((a.split("=", 1)[1] for a in args if a.startswith("batch_size=")), "16")
    common = "dataset_builder.common_config."
    args = [a for a in args if not a.startswith("batch_size=")] + [
        "recipe_name=tiny-addition",
        f"renderer_name={RENDERER}",
        "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
        f"dataset_builder.file_path={log / 'conversations.jsonl'}",
        f"{common}model_name_for_tokenizer={MODEL}",
        f"{common}renderer_name={RENDERER}",
        f"{common}max_length=512",
        f"{common}batch_size={batch}",
        f"{common}train_on_what=last_assistant_message",
    ]
    asyncio.run(train.main(chz.entrypoint(train.Config, argv=args)))


def rl_train(args: list[str]) -> None:
    """`tinker_cookbook.rl.train`, the cookbook's full RL trainer, on its GSM8K env (the addition rows
    above), with its default loss; `batch_size=N group_size=G` go to the env's builder, `async=K`
    lets sampling run up to K steps ahead of training (0 or unset: on-policy)."""
    import asyncio

    from tinker_cookbook.rl import train

    options = {"learning_rate": "1e-4", "max_tokens": "24", **dict(a.split("=", 1) for a in args)}
    batch, group, ahead = options.pop("batch_size", "4"), options.pop("group_size", "4"), int(options.pop("async", 0))
    builder = "dataset_builder."
    argv = [f"{k}={v}" for k, v in options.items()] + [
        "recipe_name=tiny-addition-rl",
        f"renderer_name={RENDERER}",
        "dataset_builder=tinker_cookbook.recipes.math_rl.math_env:Gsm8kDatasetBuilder",
        f"{builder}batch_size={batch}",
        f"{builder}group_size={group}",
        f"{builder}model_name_for_tokenizer={MODEL}",
        f"{builder}renderer_name={RENDERER}",
    ]
    if ahead:
        argv += [f"async_config.max_steps_off_policy={ahead}", f"async_config.groups_per_batch={batch}"]
    asyncio.run(train.main(chz.entrypoint(train.Config, argv=argv)))


if __name__ == "__main__":
    main(sys.argv[1:])
