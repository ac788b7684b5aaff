"""One router per concern."""
