"""Worker processes spawned by the supervisor: tokenizer, scheduler (owns the engine), detokenizer."""
