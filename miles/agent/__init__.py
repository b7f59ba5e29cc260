"""Agentic RL: the plug-in layers of a rollout and the token-in-token-out session server.

  plugins.py          the three layers' contracts (rollout, generate, agent functions) and start-up checks
  agentic.py          the generate function that runs an agent function against the session server
  trajectory.py       multi-turn token bookkeeping (loss masks, log-probs, versions) for generate functions
  gateway_client.py   what plug-ins call: the router's /generate and the session lifecycle
  gateway.py          the session server's logic: sessions, turns (tokens, generation, checkpoints)
  server.py           its HTTP front: the session routes and the router's /generate on one port
  sessions.py         checkpoints, the linear and branching rules, trajectories as samples
  tito.py             server-owned tokenisation (suffix only) and the CPU append-only check
  families.py         model families: chat template, end-of-turn token, tool-call parser
  matchers.py         when a replayed message counts as the stored one
  openai_protocol.py  the chat-completions wire format
  envs/               example environments (calculator)

See docs/agentic.md.
"""
