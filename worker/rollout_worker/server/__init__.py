"""The engine's HTTP server: SGLang's native API, OpenAI completions, and the planner's endpoints."""
