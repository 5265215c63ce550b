"""The product: a calculator assistant, written only with the `openai` SDK, as any app is.

It knows nothing of trillora. It sends the user's message with a `multiply` tool, runs the calls
the model makes, sends their results back, and returns the model's final answer. The server names
the conversation's trace in its first reply (`trace_id`); the app passes it back on the turns that
follow (OpenAI's `metadata`), and with it the user's thumbs up or down (`POST /v1/feedback`).
"""

from __future__ import annotations

import json

import openai

MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "description": "the first factor"},
                "b": {"type": "integer", "description": "the second factor"},
            },
            "required": ["a", "b"],
        },
    },
}


def multiply(a: int, b: int) -> int:
    return a * b


class Assistant:
    def __init__(self, base_url: str, api_key: str, model: str, max_turns: int = 3):
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)
        self.model, self.max_turns = model, max_turns

    def ask(self, text: str, user: str) -> tuple[str, str | None, list[float]]:
        """The final answer to `text`, the conversation's trace id, and each model call's seconds."""
        import time

        messages, trace, seconds = [{"role": "user", "content": text}], None, []
        for _ in range(self.max_turns):
            metadata = {"task": "multiply", **({"trace_id": trace} if trace else {})}
            start = time.perf_counter()
            reply = self.client.chat.completions.create(
                model=self.model, messages=messages, tools=[MULTIPLY], max_tokens=64, user=user, metadata=metadata
            )
            seconds.append(time.perf_counter() - start)
            trace = trace or (reply.model_extra or {}).get("trace_id")
            message = reply.choices[0].message
            if not message.tool_calls:
                return message.content or "", trace, seconds
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                try:
                    result = str(multiply(**json.loads(call.function.arguments)))
                except (TypeError, ValueError) as e:  # the model's arguments: the tool says what was wrong
                    result = f"error: {e}"
                messages.append(
                    {"role": "tool", "tool_call_id": call.id, "name": call.function.name, "content": result}
                )
        return "", trace, seconds

    def feedback(self, trace: str, reward: float) -> None:
        self.client.post("/feedback", body={"trace_id": trace, "reward": reward}, cast_to=dict)
