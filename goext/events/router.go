package events

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Storage tiers of RouterEvent.storage_tier.
const (
	StorageTierDevice     = "device"
	StorageTierHostPinned = "host_pinned"
	StorageTierDisk       = "disk"
	StorageTierExternal   = "external"
)

// NATS subject suffixes: "kv-events" since Dynamo PR #4921; "kv_events"
// before it (offered for older routers).
const (
	KVEventSubject       = "kv-events"
	LegacyKVEventSubject = "kv_events"
)

// RouterEvent is the JSON event a KV-aware router consumes (design §7.3):
//
//	{"worker_id": u64, "storage_tier": "device",
//	 "event": {"event_id": u64, "data": {...}, "dp_rank": u32}}
type RouterEvent struct {
	WorkerID    uint64       `json:"worker_id"`
	StorageTier string       `json:"storage_tier"`
	Event       KvCacheEvent `json:"event"`
}

// KvCacheEvent is RouterEvent.event.
type KvCacheEvent struct {
	EventID uint64           `json:"event_id"`
	Data    KvCacheEventData `json:"data"`
	DPRank  uint32           `json:"dp_rank"`
}

// KvCacheEventData is one of {"stored": {...}}, {"removed": {...}} or the
// string "cleared" (serde's externally tagged enum). Exactly one of Stored,
// Removed, Cleared is set.
type KvCacheEventData struct {
	Stored  *KvCacheStoreData
	Removed *KvCacheRemoveData
	Cleared bool
}

// KvCacheStoreData is the "stored" payload.
type KvCacheStoreData struct {
	ParentHash *uint64              `json:"parent_hash"`
	Blocks     []KvCacheStoredBlock `json:"blocks"`
}

// KvCacheStoredBlock is one stored block: the external hash the router
// indexes it under and the router local hash of its tokens.
type KvCacheStoredBlock struct {
	BlockHash  uint64 `json:"block_hash"`
	TokensHash uint64 `json:"tokens_hash"`
}

// KvCacheRemoveData is the "removed" payload.
type KvCacheRemoveData struct {
	BlockHashes []uint64 `json:"block_hashes"`
}

// MarshalJSON writes serde's externally tagged enum form.
func (d KvCacheEventData) MarshalJSON() ([]byte, error) {
	switch {
	case d.Stored != nil:
		s := *d.Stored
		if s.Blocks == nil {
			s.Blocks = []KvCacheStoredBlock{} // serde writes [], never null
		}
		return json.Marshal(struct {
			Stored KvCacheStoreData `json:"stored"`
		}{s})
	case d.Removed != nil:
		r := *d.Removed
		if r.BlockHashes == nil {
			r.BlockHashes = []uint64{}
		}
		return json.Marshal(struct {
			Removed KvCacheRemoveData `json:"removed"`
		}{r})
	case d.Cleared:
		return []byte(`"cleared"`), nil
	}
	return nil, errors.New("events: router event data: none of stored, removed, cleared is set")
}

// UnmarshalJSON reads the externally tagged enum form.
func (d *KvCacheEventData) UnmarshalJSON(b []byte) error {
	*d = KvCacheEventData{}
	b = bytes.TrimSpace(b)
	if len(b) > 0 && b[0] == '"' {
		var s string
		if err := json.Unmarshal(b, &s); err != nil {
			return fmt.Errorf("events: router event data: %w", err)
		}
		if s != "cleared" {
			return fmt.Errorf("events: router event data: unknown variant %q", s)
		}
		d.Cleared = true
		return nil
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		return fmt.Errorf("events: router event data: %w", err)
	}
	if len(m) != 1 {
		return fmt.Errorf("events: router event data: want exactly one variant, got %d keys", len(m))
	}
	if raw, ok := m["stored"]; ok {
		d.Stored = new(KvCacheStoreData)
		if err := json.Unmarshal(raw, d.Stored); err != nil {
			return fmt.Errorf("events: router event data: stored: %w", err)
		}
		return nil
	}
	if raw, ok := m["removed"]; ok {
		d.Removed = new(KvCacheRemoveData)
		if err := json.Unmarshal(raw, d.Removed); err != nil {
			return fmt.Errorf("events: router event data: removed: %w", err)
		}
		return nil
	}
	for k := range m {
		return fmt.Errorf("events: router event data: unknown variant %q", k)
	}
	return nil
}

// NewRouterEvent converts one consolidated event. The consolidated stream
// is one logical view of all tiers, so it is reported as "device" (as the
// reference does) with dp_rank 0: a router that indexes tiers separately
// would otherwise see a STORE in one tier and the matching REMOVE in
// another.
func NewRouterEvent(workerID, eventID uint64, ev *ConsolidatedEvent) RouterEvent {
	re := RouterEvent{WorkerID: workerID, StorageTier: StorageTierDevice,
		Event: KvCacheEvent{EventID: eventID}}
	switch ev.Kind {
	case KindStored:
		s := &KvCacheStoreData{Blocks: []KvCacheStoredBlock{{BlockHash: ev.BlockHash, TokensHash: ev.TokensHash}}}
		if ev.HasParent {
			p := ev.ParentHash
			s.ParentHash = &p
		}
		re.Event.Data.Stored = s
	case KindRemoved:
		re.Event.Data.Removed = &KvCacheRemoveData{BlockHashes: []uint64{ev.BlockHash}}
	default:
		re.Event.Data.Cleared = true
	}
	return re
}

// Subject returns the NATS subject of a component's KV events:
// namespace.{ns}.component.{component}.kv-events.
func Subject(namespace, component string) string {
	return SubjectWithSuffix(namespace, component, KVEventSubject)
}

// SubjectWithSuffix is Subject with another final token (LegacyKVEventSubject).
func SubjectWithSuffix(namespace, component, suffix string) string {
	return "namespace." + namespace + ".component." + component + "." + suffix
}

// ValidateSubjectToken checks that s can be one token of a NATS subject:
// non-empty, without '.', wildcards or whitespace. what names the setting
// in the error.
func ValidateSubjectToken(what, s string) error {
	if s == "" {
		return fmt.Errorf("events: %s is empty", what)
	}
	if i := strings.IndexAny(s, ".*> \t\r\n"); i >= 0 {
		return fmt.Errorf("events: %s %q contains %q, which a NATS subject token cannot hold", what, s, s[i])
	}
	return nil
}

// Slugify is the reference's Slug::slugify: lowercase, every character
// outside [a-z0-9_-] becomes '_', leading '_' stripped.
func Slugify(s string) string {
	var b strings.Builder
	b.Grow(len(s))
	for _, r := range strings.ToLower(s) {
		if (r >= 'a' && r <= 'z') || (r >= '0' && r <= '9') || r == '_' || r == '-' {
			b.WriteRune(r)
		} else {
			b.WriteByte('_')
		}
	}
	return strings.TrimLeft(b.String(), "_")
}

// StreamName is the JetStream stream name for a subject: Slugify, then
// '_' → '-' (e.g. namespace-dynamo-component-backend-kv-events).
func StreamName(subject string) string {
	return strings.ReplaceAll(Slugify(subject), "_", "-")
}
