"""What serves one client request: a request group owns the scheduler requests it created (one sequence,
parallel samples, or beams) and the paced queue its gRPC stream reads, and decides from each step's outcome
what the client sees.

May import: core/, text/, the standard library, asyncio. Not the wire (protos, gRPC, ZeroMQ) and not api/.
"""
