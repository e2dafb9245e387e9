"""Ring attention over torch.distributed (the `ring` strategy made real).

model.py is pure Python (the planner imports it); attention.py, launch.py need torch and are imported only by
`edgekv ring` itself. This __init__ imports nothing, so `import edgekv.ring.model` never pulls in torch.
"""
