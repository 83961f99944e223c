"""The API's routes, one module per surface: thinkpool's solve and jobs, OpenAI's completions and models, health."""
