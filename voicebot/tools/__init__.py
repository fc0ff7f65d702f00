"""Function tools: declarations (spec), vLLM's parser and grammar for the model family
(parser, grammar), a session's tools and server-side webhooks (session_tools, webhook).
See docs/tools.md."""
