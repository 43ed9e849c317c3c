"""The guard's per-step device path, with no host synchronisation: the step's flags agreed across ranks (`flags`),
the update not applied when the flag says so (`skip`), the spike detector's window (`spikes`), and the logged loss
over applied steps (`ledger`)."""
