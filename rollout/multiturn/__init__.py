"""Multi-turn rollouts: the generate-plugin driver (`rollout`), the `<tool_call>` format (`tool_calls`) and a
ready-made tool-calling agent (`tool_agent`)."""
