"""``pdserve conformance URL``: the generate protocol's wire rules, run against any server.

No such suite exists for vLLM, llm-d-inference-sim or Dynamo, so "wire-compatible" was a claim checked
only against our own reading of vLLM. The kit speaks only the wire: it finds the model on ``/v1/models``,
renders its own prompts with the server's render endpoints, and checks each rule of docs/protocol.md
(rules.py holds them as data). It imports nothing else from pdserve, so it cannot share a bug with the
server it judges.
"""
