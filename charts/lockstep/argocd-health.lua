-- Argo CD health check for lockstep.dev/RLJob.
-- Install it as resource.customizations.health.lockstep.dev_RLJob in argocd-cm.
-- It reads what the operator writes: spec.suspend, status.observedGeneration, and the
-- Ready / Stalled conditions (selected by type, never by position). A job that waits in a Kueue queue is
-- Suspended, as Argo CD shows a suspended batch Job.
local hs = {}

local function condition(kind)
  if obj.status == nil or obj.status.conditions == nil then
    return nil
  end
  for _, c in ipairs(obj.status.conditions) do
    if c.type == kind then
      return c
    end
  end
  return nil
end

if obj.spec ~= nil and obj.spec.suspend == true then
  hs.status = "Suspended"
  hs.message = "spec.suspend is true: the pods are deleted and the status is kept"
  return hs
end

if obj.status == nil or obj.status.observedGeneration == nil
    or obj.status.observedGeneration < obj.metadata.generation then
  hs.status = "Progressing"
  hs.message = "waiting for the Lockstep operator to observe the latest spec"
  return hs
end

local stalled = condition("Stalled")
if stalled ~= nil and stalled.status == "True" then
  hs.status = "Degraded"
  hs.message = stalled.reason .. ": " .. stalled.message
  return hs
end

local ready = condition("Ready")
if ready ~= nil and ready.status == "True" then
  hs.status = "Healthy"
  hs.message = ready.message
  return hs
end

if ready ~= nil and ready.reason == "Queued" then
  hs.status = "Suspended"
  hs.message = ready.message
  return hs
end

hs.status = "Progressing"
if ready ~= nil then
  hs.message = ready.reason .. ": " .. ready.message
else
  hs.message = "waiting for the Lockstep operator"
end
return hs
