"""Envs that speak chat messages: the policy's turn comes in parsed (text, thinking, tool calls),
the env answers with messages (tool results, a user's reply) or ends the episode; the renderer
turns both into the tokens the engine and the trainer see.

    class Tutor(MessageEnv):
        def respond(self, turn):
            if "42" in turn.parsed.content:
                return Reply(reward=1.0, done=True)
            return Reply([{"role": "user", "content": "Not quite, try again."}])
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..chat.renderer import AssistantTurn, ChatRenderer
from .env import Env, Metrics, StepResult, resolve


@dataclass
class Reply:
    messages: list[dict] = field(default_factory=list)  # what comes next (empty when done)
    reward: float = 0.0
    done: bool = False
    metrics: Metrics = field(default_factory=dict)


class MessageEnv(Env):
    """One episode over chat messages. `tools` are JSON schemas the template puts in the prompt;
    with tools, each assistant turn is parsed for calls in the renderer's tool format."""

    def __init__(self, renderer: ChatRenderer, messages: list[dict], tools: list[dict] | None = None):
        self.renderer, self.messages, self.tools = renderer, [dict(m) for m in messages], tools or []
        self.tokens: list[int] = []

    def respond(self, turn: AssistantTurn) -> Reply:
        """The env's answer to the policy's turn (may be `async def`)."""
        raise NotImplementedError

    def initial_observation(self) -> tuple[list[int], list[int]]:
        self.tokens = self.renderer.prompt(self.messages, self.tools)
        return list(self.tokens), list(self.renderer.stop_tokens)

    def step(self, action: list[int]) -> StepResult:
        turn = self.renderer.parse(action, with_tools=bool(self.tools))
        reply = resolve(self.respond(turn))
        metrics = {"truncated": float(turn.truncated), **reply.metrics}
        history = self.messages + [turn.message]
        if reply.done:
            self.messages = history
            return StepResult(float(reply.reward), True, [], [], metrics)
        added = [dict(m) for m in reply.messages]
        more = self.renderer.continuation(history, added, self.tools, ended=not turn.truncated)
        self.messages = history + added
        if more is None:  # the template rewrites the history: a fresh rendering (a new training sequence)
            self.tokens = self.renderer.prompt(self.messages, self.tools)
            metrics["history_rewritten"] = 1.0
        else:
            self.tokens = self.tokens + list(action) + more
        return StepResult(float(reply.reward), False, list(self.tokens), list(self.renderer.stop_tokens), metrics)
