"""The settings' groups, one mixin of `Settings` each (flat `NEURON_APP_<FIELD>` names)."""
