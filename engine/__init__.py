"""engine: a ZeRO-3 engine that pages an unmodified ``torch.nn.Module``'s parameters through a
:class:`tiered.TieredStore`. Not built yet; see the issue tracker."""
