"""Served traffic as experience: the trace store, feedback, and traces as a training source."""

from .record import Recorder
from .store import Call, Feedback, TraceError, TraceStore, UnknownTrace

__all__ = ["Call", "Feedback", "Recorder", "TraceError", "TraceStore", "UnknownTrace"]
