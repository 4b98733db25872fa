"""Engine bookkeeping that never touches a device: requests, the scheduler, the block manager, recurrent-state slots, detokenization and speculative-decoding accounting."""
