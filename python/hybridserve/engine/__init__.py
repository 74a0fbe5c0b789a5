"""Engine: LLMEngine (step loop), AsyncEngine (thread + asyncio bridge), LLM (offline API)."""
