"""Served traffic as experience: the trace store, feedback, and traces as a training source."""

from .record import Recorder
from .store import Call, Feedback, TooMuchFeedback, TraceError, TraceStore, UnknownTrace

__all__ = ["Call", "Feedback", "Recorder", "TooMuchFeedback", "TraceError", "TraceStore", "UnknownTrace"]
