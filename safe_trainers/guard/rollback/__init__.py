"""The last good state and the way back to it: what both sources share (`source`), the copy in host memory
(`memory`), the newest verified checkpoint (`checkpoint`), frozen parameters checked and repaired from their files
(`frozen`), and the actions on a verdict: restore, back off, record, stop (`actions`)."""
