"""Served traffic as experience: the trace store, feedback, and traces as a training source."""

from .record import Recorder
from .store import TraceStore
from .types import Call, Feedback, OverBudget, TooMuchFeedback, TraceError, UnknownTrace

__all__ = ["Call", "Feedback", "OverBudget", "Recorder", "TooMuchFeedback", "TraceError", "TraceStore", "UnknownTrace"]
