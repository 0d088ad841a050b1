"""An MLA-first LLM serving engine."""
