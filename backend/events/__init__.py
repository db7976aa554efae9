"""The event stream: every engine decision as one event (schema), the bus that fans events out to
subscribers, the JSONL trace writer and reader, and RunState, the one reducer that rebuilds the
engine's visible state from events."""
