"""Text in and out: the tokenizer, chat templates, incremental detokenization and stop strings."""
